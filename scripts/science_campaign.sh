#!/usr/bin/env bash
# The long-answer experiment's confirmatory campaign (docs/science.md, "The amendment"): tier 1 (R, N, C) at seeds
# 1-8 on this CPU, from a `git archive` export of the commit in docs/science_long/PINNED, kept in offpolicy's cache
# (outside the work tree, which a new session lays afresh). The pinned commit's own benchmarks/science_real.py runs
# the runs with PYTHONPATH=<export>/src, refuses any whose provenance differs from the pin, and commits each
# finished run's record (docs/science_long/runs/CELL/seedN/) in this checkout at once. Blinded: nothing here prints
# an outcome; `status` gives counts and times only.
#
#   bash scripts/science_campaign.sh start [--jobs 2] [--until HOURS]   # in the background, nice'd; resumes cut runs
#   bash scripts/science_campaign.sh stop      # no more runs; the running ones checkpoint (SIGTERM) and resume later
#   bash scripts/science_campaign.sh status    # done / running / left, seconds a step, hours left
#   bash scripts/science_campaign.sh export    # only lay the export (prints its directory)
#   bash scripts/science_campaign.sh replay R/seed1 [--replay-steps 2]  # rerun a record's first steps from the
#                                              # export: which keys repeated bit for bit (never a value)
#   bash scripts/science_campaign.sh stop-early calendar|run-count "why"   # the registered early stop: stops the
#                                              # runner, writes docs/science_long/STOPPED and commits it alone; no run
#                                              # starts after it, and `--report` reads seeds 1..k (k >= 5), truncated
#
# PYTHON: the interpreter (default: python3 on PATH; the project's virtualenv's, e.g. PYTHON=.venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PY=${PYTHON:-python3}
cache="${OFFPOLICY_CACHE:-$HOME/.cache/offpolicy}/science_long"
commit=$(awk 'NF {print $1; exit}' docs/science_long/PINNED)
export_dir="$cache/export-${commit:0:12}"
pidfile="$cache/runner.pid"

make_export() {
  [ -f "$export_dir/COMMIT" ] && return 0
  rm -rf "$export_dir.tmp" && mkdir -p "$export_dir.tmp"
  git archive "$commit" | tar -x -C "$export_dir.tmp"
  echo "$commit" >"$export_dir.tmp/COMMIT"  # offpolicy.measure.provenance reads an export's commit here
  mv "$export_dir.tmp" "$export_dir"
}

running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }
# the registered early stop: once committed, for good (removing the file later does not resume the campaign)
stopped_early() { [ -n "$(git log -1 --format=%H -- docs/science_long/STOPPED 2>/dev/null)" ]; }

case "${1:-status}" in
  export)
    make_export
    echo "$export_dir"
    ;;
  start)
    shift
    if stopped_early; then
      echo "science campaign: stopped early (docs/science_long/STOPPED, in git's history); no run starts after that" >&2
      exit 3
    fi
    make_export
    mkdir -p "$cache"
    if running; then echo "science campaign: already running (pid $(cat "$pidfile"), log $cache/runner.log)"; exit 0; fi
    rm -f "$cache/CAMPAIGN_STOP"
    # its own session (setsid): `stop` signals the runner and its runs together
    PYTHONPATH="$export_dir/src" setsid nice -n 10 "$PY" "$export_dir/benchmarks/science_real.py" \
      --campaign "$repo/docs/science_long" --run --commit "$repo" "$@" >>"$cache/runner.log" 2>&1 </dev/null &
    echo $! >"$pidfile"
    echo "science campaign: started from the export of ${commit:0:12} (pid $!, log $cache/runner.log)"
    ;;
  stop)
    mkdir -p "$cache" && touch "$cache/CAMPAIGN_STOP"
    if running; then
      pid=$(cat "$pidfile")
      kill -TERM -- "-$pid" 2>/dev/null || true  # the runner and its runs: each run checkpoints the steps it did
      for _ in $(seq 600); do pgrep -g "$pid" >/dev/null || break; sleep 1; done
      pgrep -g "$pid" >/dev/null && echo "science campaign: runs still writing their checkpoints (group $pid)"
    fi
    rm -f "$pidfile"
    echo "science campaign: stopped; \`start\` resumes it"
    ;;
  stop-early)
    # only the calendar or the run count may stop the campaign, never its results (docs/science.md, the amendment)
    reason=${2:-}
    why=${3:-}
    if { [ "$reason" != calendar ] && [ "$reason" != run-count ]; } || [ -z "${why//[[:space:]]/}" ] \
        || [ "$why" != "${why//$'\n'/}" ]; then
      echo 'usage: bash scripts/science_campaign.sh stop-early calendar|run-count "why" (one line)' >&2
      exit 2
    fi
    if stopped_early; then
      echo "science campaign: already stopped early: $(git log -1 --format=%s -- docs/science_long/STOPPED)" >&2
      exit 3
    fi
    bash "$repo/scripts/science_campaign.sh" stop
    # (a STOPPED an interrupted stop-early left uncommitted is written afresh)
    printf '%s %s: %s\n' "$(date -u +%Y-%m-%dT%H:%MZ)" "$reason" "$why" >docs/science_long/STOPPED
    for _ in $(seq 10); do  # the runner's own commits may hold git's index a moment
      if git add -- docs/science_long/STOPPED && \
          git commit -q --no-verify -m "science campaign: stopped early ($reason: $why)" -- docs/science_long/STOPPED
      then
        echo "science campaign: stopped early, committed: $(cat docs/science_long/STOPPED)"
        exit 0
      fi
      sleep 2
    done
    echo "science campaign: docs/science_long/STOPPED is written but could not be committed; commit it alone" >&2
    exit 1
    ;;
  replay)
    shift
    make_export
    "$PY" benchmarks/science_real.py --campaign docs/science_long --export "$export_dir" --replay "$@"
    ;;
  status)
    "$PY" benchmarks/science_real.py --campaign docs/science_long --status
    running && echo "runner: pid $(cat "$pidfile")" || echo "runner: not running"
    ;;
  *)
    echo "usage: bash scripts/science_campaign.sh start|stop|status|export|replay|stop-early" >&2
    exit 2
    ;;
esac
