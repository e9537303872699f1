#!/usr/bin/env bash
# Renders the example's report.html in headless Chromium and checks, through the report's own load-time
# self-check, that every table, chart and image has a size on the page and every image decoded; and that
# the counts are the report's: 16 tables (the last beside the codelab), 4 charts (2 bar charts, the training curve, the confusion
# heatmap), 35 images (one per class, 25 test predictions); or, for another report, the self-check line
# given as the second argument. Also saves a screenshot beside the report.
#   check_report.sh path/to/report.html ["ok tables=N charts=N images=N invisible=0"]
set -euo pipefail
report=$(realpath "$1")
browser=$(command -v chromium || command -v chromium-browser || true)
[ -n "$browser" ] || { echo "chromium not found: scripts/install-deps installs Debian's chromium"; exit 1; }
flags=(--headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=5000)
dom=$(timeout 120 "$browser" "${flags[@]}" --dump-dom "file://$report" 2>/dev/null)
check=$(grep -o 'data-check="[^"]*"' <<<"$dom" || true)
echo "rendered: ${check:-no self-check result}"
want=${2:-ok tables=16 charts=4 images=35 invisible=0}
[ "$check" = "data-check=\"$want\"" ] || { echo "FAIL: the report did not render as expected (want $want)"; exit 1; }
timeout 120 "$browser" "${flags[@]}" --window-size=1100,6400 --screenshot="$(dirname "$report")/report.png" "file://$report" >/dev/null 2>&1
[ -s "$(dirname "$report")/report.png" ] || { echo "FAIL: no screenshot"; exit 1; }
echo "screenshot: $(dirname "$report")/report.png"
