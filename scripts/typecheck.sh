#!/usr/bin/env bash
# mypy finds packages by folder, not through the installed package map (setup.py), so it reads
# trainguard from a link tree made afresh outside the repository: trainguard/'s own files, and
# agent/, trainer/, tui/ linked in where the map installs them. Its messages name repository paths.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
mypy="${MYPY:-$repo/.venv/bin/mypy}"
case "$mypy" in /*) ;; *) mypy="$PWD/$mypy" ;; esac  # the checks run from the link tree
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/trainguard"
for entry in "$repo"/trainguard/*; do
  ln -s "$entry" "$tree/trainguard/"
done
for folder in agent trainer tui; do
  ln -s "$repo/$folder" "$tree/trainguard/$folder"
done
cd "$tree"
"$mypy" --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" -p trainguard "$@" \
  | sed -e 's#^trainguard/\(agent\|trainer\|tui\)/#\1/#'
