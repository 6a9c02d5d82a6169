"""`tokenmill models list | pull NAME | rm NAME | show NAME`, `tokenmill ps` and `tokenmill health`.

Named models are the ones the package registry ships (fetched into the user cache, checked by sha256);
any local .gguf file or Hugging Face folder needs no pull and can be shown by its path. `ps` asks a
running broker what its pool serves; `health` is the check docker compose and Kubernetes run (exit 0 or 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.cli.errors import EXIT_FAILURE, CommandFailed, UserError

DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"


def _registry() -> dict[str, Any]:
    """name -> WheelAsset of the models the package registry ships."""
    from tokenmill.worker.registry_fetch import EMBEDDED_MODEL

    return {"embedded": EMBEDDED_MODEL}


ALIASES = {"smollm2-135m-instruct": "embedded", "smollm2": "embedded"}
DESCRIPTIONS = {"embedded": "SmolLM2-135M-Instruct, GGUF Q4_1 (the default model)"}


def register(sub: Any) -> None:
    m = sub.add_parser("models", help="list, fetch, remove or describe models")
    msub = m.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="the models tokenmill can fetch, and which are in the cache").set_defaults(
        func=cmd_list)
    for name, func, text in (("pull", cmd_pull, "fetch a model from the package registry into the cache"),
                             ("rm", cmd_rm, "remove a fetched model from the cache"),
                             ("show", cmd_show, "describe a model: a name from `models list`, a .gguf file or a "
                                                "Hugging Face folder")):
        p = msub.add_parser(name, help=text)
        p.add_argument("name", nargs="?" if name == "pull" else None, default="embedded",
                       help="model name" + (" (default: embedded)" if name == "pull" else ""))
        p.set_defaults(func=func)

    ps = sub.add_parser("ps", help="what a running pool serves: its models, workers and their load")
    ps.add_argument("--broker", default=DEFAULT_FRONTEND, help=f"the broker's client address (default: "
                                                              f"{DEFAULT_FRONTEND})")
    ps.add_argument("--json", action="store_true", help="print the broker's STATS reply as JSON (default: a table)")
    ps.set_defaults(func=cmd_ps)

    h = sub.add_parser("health", help="exit 0 if the gateway (--url) or broker (--broker) is healthy, else 1")
    where = h.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", default=None,
                       help="a gateway's /health URL (or its base URL, http://HOST:PORT or .../v1: /health is "
                            "added): healthy when it answers 200 (default: none)")
    where.add_argument("--broker", default=None,
                       help="a broker's client address: healthy when it answers (default: none; give --url or this)")
    h.add_argument("--worker", default=None, help="only this worker: with --broker, healthy while it is registered; "
                                                  "with --url, unless the gateway reports it unhealthy or missing "
                                                  "(default: the whole pool)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default: 3)")
    h.set_defaults(func=cmd_health)


def _asset(name: str) -> Any:
    key = ALIASES.get(name.lower(), name.lower())
    models = _registry()
    if key not in models:
        raise UserError(f"unknown model {name!r}; the registry ships: {', '.join(models)} (a local .gguf file or "
                        "Hugging Face folder needs no pull: pass its path to --model)")
    return key, models[key]


# ---- models -----------------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def cmd_list(args: argparse.Namespace) -> int:
    from tokenmill.worker.registry_fetch import asset_path, cached_path

    rows: list[tuple[str, ...]] = [("NAME", "SIZE", "STATUS", "WHAT")]
    for name, asset in _registry().items():
        cached = cached_path(asset)
        status = f"pulled: {cached}" if cached else f"not pulled (tokenmill models pull {name})"
        rows.append((name, _size(asset.size), status, DESCRIPTIONS.get(name, "")))
    _table(rows)
    print(f"cache: {asset_path(_registry()['embedded']).parents[2]}", file=sys.stderr)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from tokenmill.worker.registry_fetch import fetch

    _, asset = _asset(args.name)
    print(fetch(asset))  # progress on stderr while it downloads
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from tokenmill.worker.registry_fetch import asset_path, remove

    name, asset = _asset(args.name)
    if not remove(asset):
        raise CommandFailed(f"model {name!r} is not in the cache ({asset_path(asset)})")
    print(f"removed {name} ({asset_path(asset)})")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from tokenmill.cli.sampling_args import model_generation_defaults

    model, path, source_line = _show_target(args.name)
    from tokenmill.worker.loader import resolve_model

    load_format = "auto"
    src = resolve_model(str(path), load_format)  # type: ignore[arg-type]
    a = src.arch
    lines = [("model", model), ("source", source_line), ("path", str(path)), ("format", src.kind),
             ("architecture", a.arch),
             ("layers / hidden / ffn", f"{a.num_layers} / {a.hidden_size} / {a.intermediate_size}"),
             ("heads / kv heads / head dim", f"{a.num_heads} / {a.num_kv_heads} / {a.head_dim}"),
             ("vocabulary", str(a.vocab_size)), ("context length", str(a.max_position_embeddings)),
             ("tied embeddings", str(a.tie_word_embeddings).lower())]
    meta = src.gguf_metadata or {}
    for key, label in (("general.name", "name"), ("general.license", "license"),
                       ("general.file_type", "GGUF file type")):
        if key in meta:
            lines.append((label, _gguf_file_type(meta[key]) if key == "general.file_type" else str(meta[key])))
    template = meta.get("tokenizer.chat_template") if meta else _hf_template(path)
    lines.append(("chat template", "yes" if template else "no"))
    defaults = model_generation_defaults(str(path), load_format, download=False)
    lines.append(("sampling defaults", json.dumps(defaults) if defaults else "none (tokenmill chat's own)"))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    return 0


def _show_target(name: str) -> tuple[str, Path, str]:
    path = Path(name).expanduser()
    if path.exists():
        return path.name, path, "local"
    from tokenmill.worker.registry_fetch import cached_path

    key, asset = _asset(name)
    cached = cached_path(asset)
    if cached is None:
        raise CommandFailed(f"model {key!r} is not pulled yet: tokenmill models pull {key}")
    return key, cached, f"package registry: {asset.package}=={asset.version} ({asset.member})"


def _gguf_file_type(value: Any) -> str:
    import gguf

    try:
        return gguf.LlamaFileType(int(value)).name
    except (ValueError, TypeError):
        return str(value)


def _hf_template(path: Path) -> str | None:
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    t = cfg.get("chat_template") if isinstance(cfg, dict) else None
    return t if isinstance(t, str) else None


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


# ---- ps and health ----------------------------------------------------------------------------------


def _stats(address: str, timeout: float) -> dict[str, Any]:
    from tokenmill.client import BrokerUnavailable, Client

    try:
        with Client(address) as c:
            return c.stats(timeout=timeout)
    except BrokerUnavailable:
        raise CommandFailed(f"no broker answers at {address} (start one with tokenmill up or tokenmill serve, "
                            "or name it with --broker)") from None


def cmd_ps(args: argparse.Namespace) -> int:
    stats = _stats(args.broker, 3.0)
    if args.json:
        print(json.dumps(stats, indent=2, default=str))
        return 0
    workers = stats.get("workers") or []
    queues = stats.get("queues") or {}
    models = sorted({m for w in workers for m in w.get("models", ())} | set(queues))
    print(f"broker {args.broker}: {len(workers)} worker(s), {stats.get('active_jobs', 0)} active job(s)"
          + (", draining" if stats.get("draining") else ""))
    if not models:
        print("no model is served (no worker has registered)")
        return 0
    rows: list[tuple[str, ...]] = [("MODEL", "WORKERS", "QUEUED", "MAX CONTEXT")]
    for m in models:
        serving = [w for w in workers if m in w.get("models", ())]
        ctx = max((int(w.get("max_model_len", 0)) for w in serving), default=0)
        rows.append((m, str(len(serving)), str(queues.get(m, 0)), str(ctx) if ctx else "-"))
    _table(rows)
    print()
    rows = [("WORKER", "MODELS", "RUNNING", "WAITING", "IN FLIGHT/CAPACITY", "KV FREE", "LAST HEARD")]
    for w in workers:
        total = int(w.get("kv_blocks") or 0)
        free = int(w.get("free_blocks") or 0)
        kv = f"{free}/{total} blocks ({100 * free / total:.0f}%)" if total else "-"
        rows.append((str(w.get("name", "?")), ",".join(w.get("models", ())), str(w.get("running", 0)),
                     str(w.get("waiting", 0)), f"{w.get('inflight', 0)}/{w.get('capacity', '?')}", kv,
                     f"{float(w.get('last_seen_ago', 0)):.1f}s ago"))
    _table(rows)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when healthy; else one line saying why and exit 1."""
    if args.url:
        ok, why = _url_health(health_url(args.url), args.timeout, args.worker)
    else:
        stats = _stats(args.broker, args.timeout)
        names = {str(w.get("name")) for w in stats.get("workers") or []}
        ok = args.worker is None or args.worker in names
        why = "answers" if ok else f"worker {args.worker!r} is not registered (workers: {sorted(names) or 'none'})"
    if not ok:
        print(f"tokenmill: unhealthy: {args.url or args.broker}: {why}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def health_url(url: str) -> str:
    """`url` as a gateway's /health URL: a base URL (no path, "/" or the OpenAI base "/v1") gets "/health";
    any other path is taken as given."""
    parts = urllib.parse.urlsplit(url)
    if parts.path.rstrip("/") in ("", "/v1"):
        parts = parts._replace(path="/health")
    return urllib.parse.urlunsplit(parts)


def _url_health(url: str, timeout: float, worker: str | None) -> tuple[bool, str]:
    """A gateway's /health: 200 is healthy. With `worker`, the verdict on that worker alone (a liveness probe
    of the worker): unhealthy only when the gateway answers and reports it unhealthy, or does not list it
    while the broker answers; a gateway that does not answer cannot tell, which is not the worker's fault."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            status, body = int(r.status), r.read()
    except urllib.error.HTTPError as e:
        status, body = int(e.code), e.read()
    except (urllib.error.URLError, OSError) as e:
        return worker is not None, f"no answer ({getattr(e, 'reason', e)})"
    if worker is None:
        return status == 200, f"HTTP {status}: {body[:200].decode(errors='replace')}"
    try:
        report = json.loads(body)
    except ValueError:
        return True, f"HTTP {status}, not a health report"
    entry = next((w for w in report.get("workers") or [] if w.get("name") == worker), None)
    if entry is not None:
        return bool(entry.get("healthy")), f"worker {worker!r}: {entry.get('reason')}"
    broker_down = report.get("reason") == "broker not answering"
    return broker_down, f"worker {worker!r} is not in the pool ({report.get('reason')})"
