"""`odt bundle`, `odt keygen`, `odt verify-bundle`: thin shells over mobile_bridge."""

from __future__ import annotations

import argparse
import json

MAX_CODES = 10_000

__all__ = ["register"]


def register(commands: argparse._SubParsersAction) -> None:
    b = commands.add_parser("bundle", help="package artifacts for phone/browser runtimes (hashed, optionally signed)")
    b.add_argument("directory", help="artifact directory made by `odt generate`")
    b.add_argument("--out", required=True, help="bundle directory to create")
    b.add_argument("--sign-key", help="Ed25519 private key from `odt keygen` (default: unsigned)")
    b.add_argument("--lr", type=float, help="learning rate baked into the optimizer (default: the manifest's)")
    b.add_argument("--schedule", default="constant", choices=["constant", "linear", "cosine"], help="default constant")
    b.add_argument(
        "--total-steps", type=int, help="optimizer steps a linear/cosine schedule spans (required for those)"
    )
    b.add_argument("--warmup", type=int, default=0, help="linear warm-up steps (default 0)")
    b.add_argument("--force", action="store_true", help="replace --out if it exists")
    b.add_argument("--json", action="store_true", help="print bundle.json")
    b.set_defaults(run=_run_bundle)
    k = commands.add_parser("keygen", help="write an Ed25519 key pair: KEY (private) and KEY.pub")
    k.add_argument("--out", required=True, help="path of the private key; the public key goes to OUT.pub")
    k.add_argument("--force", action="store_true", help="replace an existing key pair")
    k.set_defaults(run=_run_keygen)
    v = commands.add_parser("verify-bundle", help="check a bundle's signature and file hashes")
    v.add_argument("bundle", help="bundle directory")
    _signature_options(v)
    v.set_defaults(run=_run_verify)
    bridge = commands.add_parser("bridge", help="the HTTP bridge that lets phones and browsers join Flower rounds")
    modes = bridge.add_subparsers(dest="mode", required=True, metavar="MODE")
    serve = modes.add_parser("serve", help="serve a bundle, tasks and updates (OpenAPI at /docs)")
    serve.add_argument("bundle", help="bundle directory made by `odt bundle`")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8765, help="default 8765")
    serve.add_argument("--max-examples", type=int, default=100_000, help="largest example count accepted")
    serve.add_argument("--demo-data", help=".npz the demo page at /web/ trains on (default: none)")
    _signature_options(serve)
    serve.add_argument("--state", help="SQLite state file (default: BUNDLE.bridge.db beside the bundle)")
    serve.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="IP",
        help="a reverse proxy whose X-Forwarded-For names the client (repeatable; default: none, the peer's "
        "own address counts, so a header cannot dodge the registration rate limit)",
    )
    serve.add_argument("--body-timeout", type=float, default=30.0,
                       help="seconds a request body may stall before a 408, and its headers may take before "
                       "the connection is closed (default 30)")  # fmt: skip
    serve.set_defaults(run=_run_serve)
    enroll = modes.add_parser("enroll", help="issue one-time enrolment codes for devices (stored hashed)")
    enroll.add_argument("bundle", help="bundle directory the bridge serves")
    enroll.add_argument("--state", help="SQLite state file (default: BUNDLE.bridge.db beside the bundle)")
    enroll.add_argument("--count", type=int, default=1, help=f"codes to issue, 1 to {MAX_CODES:,} (default 1)")
    enroll.add_argument("--json", action="store_true", help="print the codes as a JSON list")
    enroll.set_defaults(run=_run_enroll)
    deploy = modes.add_parser(
        "deploy",
        help="a real Flower deployment whose rounds phones/browsers join: SuperLink, Python SuperNodes, "
        "the bridge and one relay SuperNode per device",
    )
    deploy.add_argument("--devices", type=int, default=1, help="bridge devices, named browser-1..N (default 1)")
    deploy.add_argument("--nodes", type=int, default=0, help="Python SuperNodes beside the devices (default 0)")
    deploy.add_argument("--port", type=int, default=8765, help="the bridge's port on 127.0.0.1 (default 8765)")
    deploy.add_argument("--demo-data", help=".npz the demo page trains on (default: DATA/train.npz)")
    from federated.cli import add_run_options

    add_run_options(deploy)
    deploy.set_defaults(run=_run_deploy, round_timeout=300.0)


def _run_bundle(args: argparse.Namespace) -> int:
    from .bundle import make_bundle

    description = make_bundle(
        args.directory, args.out, sign_key=args.sign_key, lr=args.lr, schedule=args.schedule,
        total_steps=args.total_steps, warmup=args.warmup, force=args.force,
    )  # fmt: skip
    if args.json:
        print(json.dumps(description, indent=2))
    else:
        size = sum(f["bytes"] for f in description["files"].values())
        print(f"bundle: {args.out} ({len(description['files'])} files, {size / 1024:.0f} KiB"
              f"{', signed' if args.sign_key else ', unsigned'})")  # fmt: skip
    return 0


def _run_keygen(args: argparse.Namespace) -> int:
    from .signing import keygen

    private, public = keygen(args.out, force=args.force)
    print(f"private key: {private}\npublic key: {public}")
    return 0


def _signature_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--public-key", help="KEY.pub of the signer: the bundle must carry its valid signature "
                        "(default: none; a signed bundle then needs --skip-signature)")  # fmt: skip
    parser.add_argument("--skip-signature", action="store_true", help="accept a signed bundle without checking "
                        "its signature (only the file hashes, which whoever alters a file can recompute)")  # fmt: skip


def _check_port(port: int) -> None:
    from .errors import BridgeOptionError

    if not 1 <= port <= 65535:
        raise BridgeOptionError(f"--port must be a TCP port, 1 to 65535, got {port}.")


def _run_verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .bundle import SIGNATURE, verify_bundle

    description = verify_bundle(args.bundle, args.public_key, skip_signature=args.skip_signature)
    signed = "signature and " if args.public_key else ""
    skipped = not args.public_key and (Path(args.bundle) / SIGNATURE).exists()
    unchecked = "; the signature was NOT checked (--skip-signature)" if skipped else ""
    print(f"ok: {signed}{len(description['files'])} file hashes verified{unchecked}")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    import ipaddress
    import os
    import secrets

    import uvicorn

    from .errors import BridgeOptionError
    from .headers import header_deadline
    from .server import create_app

    secret = os.environ.get("ODT_BRIDGE_SECRET")
    if not secret:
        secret = secrets.token_urlsafe(32)
        print(f"relay secret (give it to relay SuperNodes as ODT_BRIDGE_SECRET): {secret}", flush=True)
    _check_port(args.port)
    if args.max_examples < 1:
        raise BridgeOptionError(f"--max-examples must be at least 1, got {args.max_examples}.")
    for proxy in args.trusted_proxy:
        try:
            ipaddress.ip_network(proxy, strict=False)
        except ValueError:
            raise BridgeOptionError(f"--trusted-proxy takes an IP address or network (10.0.0.5, 10.0.0.0/8), "
                                    f"got {proxy!r}.") from None  # fmt: skip
    if not 0 < args.body_timeout <= 3600:
        raise BridgeOptionError(f"--body-timeout must be in (0, 3600] seconds, got {args.body_timeout}.")
    app = create_app(args.bundle, relay_secret=secret, max_examples=args.max_examples, demo_data=args.demo_data,
                     state=args.state, body_timeout=args.body_timeout, public_key=args.public_key,
                     skip_signature=args.skip_signature)  # fmt: skip
    if not os.environ.get("ODT_BRIDGE_ENROLMENT") and not app.state.store.has_codes():
        print("registration is closed: set ODT_BRIDGE_ENROLMENT or issue codes with `odt bridge enroll`", flush=True)
    print(f"bridge: http://{args.host}:{args.port}  (OpenAPI: /docs, demo page: /web/)", flush=True)
    proxies = ",".join(args.trusted_proxy)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", proxy_headers=bool(proxies),
                forwarded_allow_ips=proxies or None, http=header_deadline(args.body_timeout))  # fmt: skip
    return 0


def _run_enroll(args: argparse.Namespace) -> int:
    import secrets
    from pathlib import Path

    from .bundle import verify_bundle
    from .errors import BridgeOptionError
    from .store import Store

    if not 1 <= args.count <= MAX_CODES:
        raise BridgeOptionError(f"--count must be 1 to {MAX_CODES:,}, got {args.count:,}; issue more in several calls.")
    verify_bundle(args.bundle, skip_signature=True)  # codes for the bridge's state: its serve checks the signature
    store = Store(
        Path(args.state) if args.state else Path(args.bundle).with_name(f"{Path(args.bundle).name}.bridge.db")
    )
    codes = [secrets.token_urlsafe(12) for _ in range(args.count)]
    store.add_codes(codes)
    store.close()
    print(json.dumps(codes) if args.json else "\n".join(codes))
    return 0


def _run_deploy(args: argparse.Namespace) -> int:
    import os
    import secrets
    import sys
    import time
    import urllib.request
    from pathlib import Path

    from federated.cli import echo_rounds, run_config, run_lock
    from federated.errors import RunConfigError
    from federated.runner import deploy

    from .bundle import make_bundle
    from .errors import BridgeError

    _check_port(args.port)
    if args.devices < 1 or args.nodes < 0:
        raise RunConfigError(f"--devices must be >= 1 and --nodes >= 0, got {args.devices} and {args.nodes}.")
    config = run_config(args)
    config["min-nodes"] = max(int(config.get("min-nodes", 2)), args.devices + args.nodes)  # wait for the devices
    out = Path(config["output"])
    with run_lock(out):
        bundle = out / "bundle"
        make_bundle(config["artifacts"], bundle, force=True)
        if not args.resume:  # a new run: new devices
            for name in ("bridge.db", "bridge.db-wal", "bridge.db-shm"):
                (out / name).unlink(missing_ok=True)
        secret = secrets.token_urlsafe(32)
        enrolment = os.environ.get("ODT_BRIDGE_ENROLMENT") or secrets.token_urlsafe(12)
        demo = args.demo_data or str(Path(config["data"]) / "train.npz")
        url = f"http://127.0.0.1:{args.port}"

        def node_config(i: int) -> str:
            if i < args.nodes:
                return f"partition-id={i} num-partitions={args.nodes}"
            return f'bridge-url="{url}" bridge-device="browser-{i - args.nodes + 1}" bridge-secret="{secret}"'

        def start_bridge(group) -> None:  # type: ignore[no-untyped-def]
            odt = str(Path(sys.executable).parent / "odt")
            serve = [odt, "bridge", "serve", str(bundle), "--port", str(args.port), "--demo-data", demo,
                     "--state", str(out / "bridge.db")]  # fmt: skip
            process = group.start("bridge", serve, extra_env={"ODT_BRIDGE_SECRET": secret,
                                                              "ODT_BRIDGE_ENROLMENT": enrolment})  # fmt: skip
            deadline = time.monotonic() + 60
            while True:  # up, dead, or too slow: never tell the user to open a page nobody serves
                if process.poll() is not None:
                    log = group.log_path("bridge").read_text(errors="replace").strip().splitlines()[-3:]
                    raise BridgeError(f"the bridge exited with code {process.returncode}: {' | '.join(log)}")
                try:
                    urllib.request.urlopen(f"{url}/openapi.json", timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise BridgeError(f"the bridge did not answer on {url} within 60 s; see "
                                          f"{group.log_path('bridge')}.") from None  # fmt: skip
                    time.sleep(0.2)
            names = ", ".join(f"browser-{k + 1}" for k in range(args.devices))
            print(f"bridge: open {url}/web/#enrol={enrolment} in {args.devices} browser(s) and join as {names} "
                  f"(each round waits up to {config['round-timeout']:.0f} s)", flush=True)  # fmt: skip

        report = deploy(
            args.nodes + args.devices,
            config,
            work=out / "logs",
            node_config=node_config,
            on_line=(lambda line: None) if args.json else echo_rounds,
            after_start=start_bridge,
        )
    if args.json:
        print(json.dumps(report, indent=2))
    return 0
