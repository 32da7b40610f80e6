"""``mmsdk plugins``: every plugin and what it contributes (adapters, passes, backends, models)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mmsdk.cli._common import print_table


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("plugins", help="list plugins and what each contributes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from mmsdk.core.session import Session

    session = Session.create()
    infos = session.plugin_infos()
    if args.json:
        data = [
            {
                "name": info.origin.name,
                "distribution": info.origin.distribution,
                "version": info.origin.version,
                "builtin": info.origin.builtin,
                "contributes": [{"kind": kind, "name": name} for kind, name in info.contributions],
            }
            for info in infos
        ]
        print(json.dumps(data, indent=1))
        return 0
    rows = []
    for info in infos:
        source = f"{info.origin.distribution} {info.origin.version}".strip()
        for kind, name in info.contributions or (("(nothing)", ""),):
            rows.append((name, kind, info.origin.name, source))
    print_table("mmsdk plugins", ("name", "kind", "plugin", "from"), rows)
    return 0
