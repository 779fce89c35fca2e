"""`tokenmill keys add|list|revoke`: tenants and API keys in a SQLite file."""

from __future__ import annotations

import datetime as dt
from typing import Optional

import typer

keys_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Manage tenants and API keys.")
DB_HELP = "SQLite file holding tenants and (hashed) keys."
DEFAULT_DB = "tokenmill-keys.db"


@keys_app.command("add")
def add(
    tenant: str = typer.Argument(..., help="Tenant name (created if new; its limits are replaced if given)."),
    rpm: Optional[int] = typer.Option(None, "--rpm", help="Requests per minute."),
    tpm: Optional[int] = typer.Option(None, "--tpm", help="Prompt + output tokens per minute."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="Requests in flight at once."),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens"),
    max_output_tokens: Optional[int] = typer.Option(None, "--max-output-tokens",
                                                    help="Longer output ends with finish_reason 'length'."),
    max_n: Optional[int] = typer.Option(None, "--max-n"),
    max_work_tokens: Optional[int] = typer.Option(None, "--max-work-tokens",
                                                  help="Per request: prompt + all output tokens."),
    work_budget: Optional[int] = typer.Option(None, "--work-budget", help="Tokens per --work-window, all requests."),
    work_window: float = typer.Option(3600.0, "--work-window", help="Seconds."),
    budget_usd: Optional[float] = typer.Option(None, "--budget-usd", help="Spend per --budget-period."),
    budget_period: float = typer.Option(86400.0, "--budget-period", help="Seconds."),
    alarm_usd: Optional[float] = typer.Option(None, "--alarm-usd",
                                              help="Spend alarm: raised (logged, counted in /metrics) while spend "
                                                   "in the trailing --alarm-window exceeds this."),
    alarm_window: float = typer.Option(3600.0, "--alarm-window", help="Seconds."),
    alarm_block: bool = typer.Option(False, "--alarm-block", help="Refuse requests (429) while the alarm is raised."),
    default_class: str = typer.Option("interactive", "--class", help="Default request class: interactive|batch."),
    allow_batch: bool = typer.Option(True, "--allow-batch/--no-batch"),
    allow_interactive: bool = typer.Option(True, "--allow-interactive/--batch-only"),
    models: Optional[str] = typer.Option(None, "--models",
                                         help="Comma-separated models and LoRA adapters the key may name "
                                              "(default: all); others answer 404."),
    admin: Optional[bool] = typer.Option(None, "--admin/--no-admin",
                                         help="The tenant sees every tenant's usage and the server's state in "
                                              "the console (/v1/stats); default: unchanged (new: no)."),
    capture: bool = typer.Option(False, "--capture",
                                 help="Capture this tenant's requests for replay (token ids, parameters, snapshot) "
                                      "on a server run with --capture keys (docs/capture.md)."),
    db: str = typer.Option(DEFAULT_DB, "--db", help=DB_HELP),
) -> None:
    """Create a key for TENANT and print it (shown only this once)."""
    from tokenmill.server.keys import KeyStore, TenantLimits

    allowed = tuple(c for c, ok in (("interactive", allow_interactive), ("batch", allow_batch)) if ok)
    given = any(v is not None for v in (rpm, tpm, max_concurrency, max_prompt_tokens, max_output_tokens, max_n,
                                        max_work_tokens, work_budget, budget_usd, alarm_usd, models)) or capture
    try:
        limits = TenantLimits(rpm=rpm, tpm=tpm, max_concurrency=max_concurrency, max_prompt_tokens=max_prompt_tokens,
                              max_output_tokens=max_output_tokens, max_n=max_n, max_work_tokens=max_work_tokens,
                              work_budget_tokens=work_budget, work_window_s=work_window,
                              spend_budget_usd=budget_usd, spend_period_s=budget_period,
                              spend_alarm_usd=alarm_usd, spend_alarm_window_s=alarm_window,
                              spend_alarm_block=alarm_block,
                              default_class=default_class, allowed_classes=allowed, capture=capture,
                              allowed_models=tuple(m.strip() for m in models.split(",") if m.strip())
                              if models is not None else None)
        store = KeyStore(db)
        existing = store.tenant(tenant)
        key = store.add_key(tenant, limits if (given or existing is None or default_class != "interactive"
                                               or allowed != ("interactive", "batch")) else None, admin=admin)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(key)


@keys_app.command("list")
def list_keys(db: str = typer.Option(DEFAULT_DB, "--db", help=DB_HELP)) -> None:
    """List keys (prefixes only) and tenants' limits."""
    from tokenmill.server.keys import KeyStore

    store = KeyStore(db)
    for t in store.tenants():
        lim = {k: v for k, v in t.limits.__dict__.items() if v is not None}
        typer.echo(f"tenant {t.name}{' (admin)' if t.admin else ''}: {lim}")
    for k in store.list_keys():
        state = "revoked " + dt.datetime.fromtimestamp(k.revoked).isoformat(timespec="seconds") if k.revoked else "active"
        created = dt.datetime.fromtimestamp(k.created).isoformat(timespec="seconds")
        typer.echo(f"key {k.key_id}  {k.prefix}...  tenant={k.tenant}  created={created}  {state}")


@keys_app.command("revoke")
def revoke(
    key_id: Optional[int] = typer.Option(None, "--id", help="Key id (from `keys list`)."),
    key: Optional[str] = typer.Option(None, "--key", help="The key itself."),
    tenant: Optional[str] = typer.Option(None, "--tenant", help="Revoke every key of this tenant."),
    db: str = typer.Option(DEFAULT_DB, "--db", help=DB_HELP),
) -> None:
    """Revoke a key, or every key of a tenant."""
    from tokenmill.server.keys import KeyStore

    if sum(x is not None for x in (key_id, key, tenant)) != 1:
        typer.echo("error: give exactly one of --id, --key, --tenant", err=True)
        raise typer.Exit(2)
    n = KeyStore(db).revoke(key=key, key_id=key_id, tenant=tenant)
    typer.echo(f"revoked {n} key(s)")
    if n == 0:
        raise typer.Exit(1)
