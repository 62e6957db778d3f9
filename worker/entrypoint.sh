#!/bin/sh
# Container entrypoint: `exec` so the pagestream process is PID 1's replacement and gets
# SIGTERM itself (a worker warm-stops: drains in-flight jobs) instead of a shell swallowing it.
set -e
if [ "$#" -eq 0 ]; then
  set -- worker
fi
case "$1" in
  -*|worker|bulk-worker|gateway|serve|submit|tail|stats|status|cancel|dlq|bulk) exec pagestream "$@" ;;
  *) exec "$@" ;;
esac
