"""`dss model pull`: prepare (and verify) the default model under DATA_DIR/models/."""

from __future__ import annotations

from typing import Annotated

import typer

from api.cli.common import DataDirOpt, settings_or_exit

model_app = typer.Typer(help="The default model.", no_args_is_help=True)


@model_app.command("pull")
def model_pull(
    data_dir: DataDirOpt = None,
    verify: Annotated[
        bool | None,
        typer.Option("--verify/--no-verify", help="Check the model answers correctly (default: when new)"),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="Verify in this dtype (default: the served one, DSS_ENGINE__DTYPE)"),
    ] = None,
) -> None:
    """Prepare the default model (SmolLM2-135M-Instruct) under DATA_DIR/models/."""
    from dss.errors import DSSError
    from engine_patch.setup.model import (
        default_data_dir,
        default_model_dir,
        is_ready,
        pull_default_model,
        verify_model,
    )

    root = (data_dir or default_data_dir()).expanduser()
    fresh = not is_ready(default_model_dir(root))
    dtype = dtype or settings_or_exit("dss model pull").engine.dtype
    if dtype not in (None, "float32", "bfloat16", "float16"):
        typer.echo(f"dss model pull: --dtype must be float32, bfloat16 or float16, not {dtype!r}", err=True)
        raise typer.Exit(2)
    try:
        path = pull_default_model(root)
        typer.echo(str(path))
        if verify if verify is not None else fresh:
            typer.echo(f"verified: {verify_model(path, dtype=dtype)}", err=True)
    except DSSError as exc:  # one line, not a traceback: the message says what failed
        typer.echo(f"dss model pull: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
