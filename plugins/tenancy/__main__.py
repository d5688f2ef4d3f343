"""``python -m plugins.tenancy hash-key``: print the digest of a key (read from stdin) for config.yaml.

The pepper is read from the environment variable the plugin config names (``--pepper-env``, default
``GATEWAY_TENANCY_PEPPER``): run this where the gateway's secrets are set. The key is never echoed.
"""

from __future__ import annotations

import argparse
import os
import sys

from plugins.tenancy.keys import hash_key, new_key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugins.tenancy")
    sub = parser.add_subparsers(dest="command", required=True)
    hashing = sub.add_parser("hash-key", help="digest of the key on stdin (or of a new key with --new)")
    hashing.add_argument("--pepper-env", default="GATEWAY_TENANCY_PEPPER")
    hashing.add_argument("--new", action="store_true", help="make a new key; print it once, then its digest")
    args = parser.parse_args(argv)
    pepper = os.environ.get(args.pepper_env, "").encode()
    if args.new:
        key = new_key()
        print(f"key:  {key}")
    else:
        key = sys.stdin.readline().strip()
        if not key:
            parser.error("no key on stdin")
    print(f"hash: {hash_key(key, pepper)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
