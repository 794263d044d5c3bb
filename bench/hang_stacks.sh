#!/usr/bin/env bash
# Native stacks of every thread of the Python processes under PID (a process stuck in a
# driver call or a lock): /proc's view of each thread, then gdb's (cuda-gdb where plain gdb
# is missing), for processes whose command line names python.
#
#   bench/hang_stacks.sh PID
set -u
root=$1
# PID and all its descendants (compute-sanitizer starts the Python process as a child).
all=$root
frontier=$root
while [ -n "$frontier" ]; do
    next=""
    for p in $frontier; do
        next+=" $(ps -o pid= --ppid "$p" 2>/dev/null | tr '\n' ' ')"
    done
    frontier=$(echo $next)
    all+=" $frontier"
done
for pid in $all; do
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || continue
    [[ $cmd == *python* ]] || continue
    echo "=== process $pid: $cmd"
    for t in /proc/"$pid"/task/*; do
        echo "thread ${t##*/}: $(cat "$t/comm" 2>/dev/null) state $(awk '{print $3}' "$t/stat" 2>/dev/null) wchan $(cat "$t/wchan" 2>/dev/null)"
    done
    dbg=$(command -v gdb || command -v cuda-gdb)
    if [ -n "$dbg" ]; then
        timeout 60 "$dbg" -p "$pid" -batch -ex "set pagination off" -ex "thread apply all bt 30" 2>&1 | grep -v "^\[New LWP"
    else
        echo "no gdb: only /proc's view"
    fi
done
