"""`dss users erase|verify`: they open the store itself (the pages on disk are part of an
erasure), so they need the data directory free: with a server running, erase through its API."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from api.cli.common import DataDirOpt, DbUrlOpt, settings_or_exit

if TYPE_CHECKING:
    from pydantic import BaseModel

    from dss.ops.erasure.verify import Verification
    from dss.store import Store

users_app = typer.Typer(
    help="Erase a user and verify erasure receipts (on a data directory no server owns).",
    no_args_is_help=True,
)


# Opening the store to erase makes no arena (the host tier is empty at start, and arenas are made
# on first use), but the host tier checks its capacity fits in /dev/shm: ask for little.
_CLI_HOST_CAPACITY = 16 << 20


@contextmanager
def _open_store(command: str, data_dir: Path | None, db_url: str | None) -> Iterator[Store]:
    """The store of the server's data directory, opened by this process; exit 2 with one line
    when a server owns it (the owner lock)."""
    from api.keys.store_tables import StoreTables
    from dss.errors import DataDirInUse
    from dss.store import Store

    settings = settings_or_exit(command, store={"data_dir": data_dir, "db_url": db_url})
    config = replace(settings.store.to_config(), host_capacity_bytes=_CLI_HOST_CAPACITY, codec_process=False)
    try:
        store = Store.open(config, api_tables=StoreTables())
    except DataDirInUse:
        typer.echo(
            f"{command}: a running server owns the data directory {config.data_dir}; ask it instead "
            "(DELETE /v1/users/{user_id} with an admin key or the user's own, "
            "GET /v1/erasures/{receipt_id}), or stop it first",
            err=True,
        )
        raise typer.Exit(2) from None
    try:
        yield store
    finally:
        store.close()


def _print_verified(out: BaseModel, verification: Verification) -> None:
    """Print `out` as JSON; exit 1 when the verification found remnants or a broken chain."""
    typer.echo(out.model_dump_json(indent=2))
    if verification.remnants or not verification.chain_ok:
        raise typer.Exit(1)


@users_app.command("erase")
def users_erase(
    user: Annotated[str, typer.Argument(help="The user id (any id a key or request ever used)")],
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Erase everything the store holds of USER; print the verified receipt as JSON (exit 1 when
    its verification finds remnants or a broken receipt chain)."""
    from api.keys.api_keys import ApiKeys
    from api.routes.users import erasable_user, receipt_out
    from dss.errors import DSSError, InvalidInput
    from dss.inputs import check_stored_user_id

    command = "dss users erase"
    try:
        check_stored_user_id(user)  # before opening anything
    except InvalidInput as exc:
        typer.echo(f"{command}: {exc}", err=True)
        raise typer.Exit(2) from None
    with _open_store(command, data_dir, db_url) as store:
        try:
            user = erasable_user(store, ApiKeys(store.sf), user)
        except InvalidInput as exc:
            typer.echo(f"{command}: {exc}", err=True)
            raise typer.Exit(2) from None
        try:
            out = receipt_out(store, store.eraser.erase_user(user))
        except DSSError as exc:
            typer.echo(f"{command}: {type(exc).__name__}: {exc}", err=True)
            raise typer.Exit(1) from None
        verification = store.eraser.verify(out.id)
    _print_verified(out, verification)


@users_app.command("verify")
def users_verify(
    receipt_id: Annotated[str, typer.Argument(help="An erasure receipt id (era_...)")],
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Verify an erasure receipt afresh and print the verification as JSON (exit 1 when it finds
    remnants or a broken receipt chain, or there is no such receipt)."""
    from api.routes.users import verification_out
    from dss.errors import DSSError

    command = "dss users verify"
    with _open_store(command, data_dir, db_url) as store:
        try:
            verification = store.eraser.verify(receipt_id)
        except DSSError as exc:
            typer.echo(f"{command}: {exc}", err=True)
            raise typer.Exit(1) from None
    _print_verified(verification_out(verification), verification)
