"""Command line: tinykv DIR (get KEY | put KEY VALUE [--ttl S] | delete KEY | scan [PREFIX] | compact)."""

from __future__ import annotations

import argparse
import sys

from tinykv.store import Store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinykv")
    parser.add_argument("directory")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("get").add_argument("key")
    put = sub.add_parser("put")
    put.add_argument("key")
    put.add_argument("value")
    put.add_argument("--ttl", type=float, default=None)
    sub.add_parser("delete").add_argument("key")
    sub.add_parser("scan").add_argument("prefix", nargs="?", default="")
    sub.add_parser("compact")
    args = parser.parse_args(argv)

    with Store(args.directory) as db:
        if args.command == "get":
            value = db.get(args.key)
            if value is None:
                print(f"{args.key}: not found", file=sys.stderr)
                return 1
            print(value.decode("utf-8", errors="replace"))
        elif args.command == "put":
            db.put(args.key, args.value.encode("utf-8"), ttl_s=args.ttl)
        elif args.command == "delete":
            return 0 if db.delete(args.key) else 1
        elif args.command == "scan":
            for key, value in db.scan(args.prefix):
                print(f"{key}\t{value.decode('utf-8', errors='replace')}")
        else:
            db.compact()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
