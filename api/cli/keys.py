"""`dss keys create|list|revoke|rotate-master`. `create`, `list` and `revoke` work on the database
directly (they do not need the server, and may run while the server runs); `rotate-master` runs
only while no server owns the store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from api.cli.common import DataDirOpt, DbUrlOpt, settings_or_exit

keys_app = typer.Typer(
    help="API keys (the secret is printed once; only its hash is stored).", no_args_is_help=True
)


def _db_url(data_dir: Path | None, db_url: str | None) -> str:
    settings = settings_or_exit("dss keys", store={"data_dir": data_dir, "db_url": db_url})
    return settings.store.to_config().resolved_db_url


@keys_app.command("create")
def keys_create(
    user: Annotated[str | None, typer.Option(help="The user this key acts as")] = None,
    admin: Annotated[
        bool, typer.Option("--admin", help="May erase users, manage prefixes, read metrics")
    ] = False,
    frontend: Annotated[
        str | None,
        typer.Option(
            help="A key of this frontend (registered if it is not): it acts for the end users each "
            "request names, as the users FRONTEND/<end user> (docs/frontends.md)"
        ),
    ] = None,
    user_header: Annotated[
        list[str] | None,
        typer.Option(
            "--user-header",
            help="With --frontend: a header the frontend's keys trust to name the end user, e.g. "
            "X-OpenWebUI-User-Id (repeatable; replaces the frontend's list)",
        ),
    ] = None,
    session_header: Annotated[
        str | None,
        typer.Option(
            "--session-header",
            help="With --frontend: a header that names the session, e.g. X-OpenWebUI-Chat-Id",
        ),
    ] = None,
    lead_updates: Annotated[
        str | None,
        typer.Option(
            "--lead-updates",
            help="With --frontend: off, volatile or any — turns whose system prompt changed still "
            "extend their version (docs/frontends.md, 'Volatile system prompts')",
        ),
    ] = None,
    volatile_pattern: Annotated[
        list[str] | None,
        typer.Option(
            "--volatile-pattern",
            help="With --frontend: a regular expression naming one of its own volatile values "
            "(repeatable; replaces the frontend's list)",
        ),
    ] = None,
    trust_dss_user_header: Annotated[
        bool | None,
        typer.Option(
            "--trust-dss-user-header/--no-trust-dss-user-header",
            help="With --frontend: whether its keys take the end user from X-DSS-User (default on; "
            "off for a frontend that forwards its users' headers)",
        ),
    ] = None,
    trust_body_user: Annotated[
        bool | None,
        typer.Option(
            "--trust-body-user/--no-trust-body-user",
            help="With --frontend: whether its keys take the end user from the body's `user` and "
            "`safety_identifier` (default on; off for a frontend that forwards its users' body parameters)",
        ),
    ] = None,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Create an API key and print it (once)."""
    from api.keys.api_keys import ApiKeys
    from api.keys.audit import ACTOR_CLI
    from api.keys.frontends import KEEP, Frontends
    from dss.db.connect import make_engine, make_session_factory, upgrade_to_head
    from dss.errors import DSSError

    if sum((user is not None, admin, frontend is not None)) != 1:
        raise typer.BadParameter("give one of --user NAME, --admin, --frontend NAME")
    sources = {"trust_dss_user_header": trust_dss_user_header, "trust_body_user": trust_body_user}
    chosen = {k: v for k, v in sources.items() if v is not None}
    if frontend is None and (user_header or session_header or lead_updates or volatile_pattern or chosen):
        raise typer.BadParameter(
            "--user-header, --session-header, --lead-updates, --volatile-pattern and the --trust-... "
            "options go with --frontend"
        )
    url = _db_url(data_dir, db_url)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        sf = make_session_factory(engine)
        if frontend is not None:
            frontends = Frontends(sf)
            given = (user_header, session_header, lead_updates, volatile_pattern)
            registered = frontends.ensure(
                frontend,
                ACTOR_CLI,
                user_header or [],
                session_header,
                lead_updates,
                volatile_pattern or [],
                trust_dss_user_header=trust_dss_user_header is not False,  # unset: on
                trust_body_user=trust_body_user is not False,
            )
            if registered:
                typer.echo(f"registered frontend {frontend!r}", err=True)
            elif any(g is not None for g in given) or chosen:
                frontends.update(
                    frontend,
                    ACTOR_CLI,
                    user_headers=user_header if user_header is not None else KEEP,
                    session_header=session_header if session_header is not None else KEEP,
                    trust_dss_user_header=KEEP if trust_dss_user_header is None else trust_dss_user_header,
                    trust_body_user=KEEP if trust_body_user is None else trust_body_user,
                    lead_updates=lead_updates if lead_updates is not None else KEEP,
                    volatile_patterns=volatile_pattern if volatile_pattern is not None else KEEP,
                )
                typer.echo(f"updated the settings of frontend {frontend!r}", err=True)
        created = ApiKeys(sf).create(user, admin=admin, frontend=frontend)
    except DSSError as exc:  # a name or header off its rule, a frontend name stored data uses
        raise typer.BadParameter(str(exc)) from None
    finally:
        engine.dispose()
    if created.frontend is not None:
        typer.echo(
            f"created frontend key {created.id} for frontend {created.frontend!r}; it is shown only now:",
            err=True,
        )
    else:
        kind = "admin key" if created.is_admin else "key"
        typer.echo(f"created {kind} {created.id} for user {created.user!r}; it is shown only now:", err=True)
    typer.echo(created.key)


@keys_app.command("list")
def keys_list(data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """List keys (ids, owners, kinds; never the secrets) and the registered frontends."""
    from api.keys.api_keys import ApiKeys
    from api.keys.frontends import Frontends
    from dss.db.connect import make_engine, make_session_factory, upgrade_to_head

    url = _db_url(data_dir, db_url)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        sf = make_session_factory(engine)
        for k in ApiKeys(sf).list():
            state = f"revoked {k.revoked_at:%Y-%m-%d}" if k.revoked_at else "active"
            owner = f"frontend:{k.frontend}" if k.frontend is not None else k.user
            typer.echo(f"{k.id}\t{owner}\t{k.kind}\t{state}")
        for f in Frontends(sf).list():
            headers = ",".join(f.user_headers) or "-"
            typer.echo(
                f"frontend\t{f.name}\tuser headers: {headers}\tsession header: {f.session_header or '-'}"
                f"\tlead updates: {f.lead_updates or 'server'}"
                f"\tX-DSS-User: {'trusted' if f.trust_dss_user_header else 'refused'}"
                f"\tbody user: {'trusted' if f.trust_body_user else 'refused'}"
            )
    finally:
        engine.dispose()


@keys_app.command("revoke")
def keys_revoke(key_id: str, data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """Revoke a key by id (a running server stops accepting it within its key cache TTL)."""
    from api.keys.api_keys import ApiKeys
    from dss.db.connect import make_engine, make_session_factory, upgrade_to_head

    url = _db_url(data_dir, db_url)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        if not ApiKeys(make_session_factory(engine)).revoke(key_id):
            typer.echo(f"no active key {key_id}", err=True)
            raise typer.Exit(1)
    finally:
        engine.dispose()
    typer.echo(f"revoked {key_id}", err=True)


@keys_app.command("rotate-master")
def keys_rotate_master(
    new_key_file: Annotated[
        Path | None,
        typer.Option(
            "--new-key-file",
            help="Write the new master key to this new file (required when the key comes from "
            "DSS_MASTER_KEY); default: over the current key file",
        ),
    ] = None,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Re-wrap every data key and the server secret under a new master key; the old one stops
    opening the store. Offline: stop every server of the store first."""
    from dss.errors import DataDirInUse, WrongMasterKey
    from dss.ops.key_changes.master_rotation import rotate_master

    settings = settings_or_exit("dss keys rotate-master", store={"data_dir": data_dir, "db_url": db_url})
    try:
        report = rotate_master(
            settings.store.to_config(), new_key_file.expanduser() if new_key_file else None
        )
    except (DataDirInUse, WrongMasterKey) as exc:
        typer.echo(f"dss keys rotate-master: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"re-wrapped {report.data_keys} data key(s) and the server secret; "
        f"new master key in {report.key_file}"
    )
    if report.removed_key_file is not None:
        typer.echo(f"the old key file {report.removed_key_file} was overwritten and removed", err=True)
    typer.echo("start every server of this store with the new key; the old one opens nothing now", err=True)
