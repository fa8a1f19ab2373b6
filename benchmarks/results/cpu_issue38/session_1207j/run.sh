#!/usr/bin/env bash
# Issue 38: speed and memory before and after the 2026-12-07 eighth session's line cuts, with
# the earlier sessions' commands (session_1207h/run.sh), written into this folder.
# usage: run.sh BEFORE_TREE AFTER_TREE   (before: a checkout of b7b7371; after: main)
here=$(cd "$(dirname "$0")" && pwd)
exec bash "$here/../session_1207h/run.sh" "$1" "$2" "$here"
