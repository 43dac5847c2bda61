#!/bin/bash
# Runs inside a container booted with systemd as PID 1 (tests/systemd/test_systemd_service.py), as the
# unit tg-steps.service: installs trainguard-agent.service the way docs/service.md says and checks it
# under a real service manager. One "key=value" line per finding in /res/results.txt; the test on
# the host judges them. The checkout is bound read-only at its own path, /usr/local/bin is a
# writable bind (the rest of /usr is the host's, read-only).
set -u
REPO="$1"
R=/res/results.txt
: > "$R"
say() { printf '%s=%s\n' "$1" "$2" >> "$R"; }
unit=trainguard-agent
prop() { systemctl show -p "$1" --value "$unit"; }
wait_for() {  # wait_for SECONDS CMD...: until CMD succeeds
    local n=$(( $1 * 4 )); shift
    while [ "$n" -gt 0 ]; do "$@" && return 0; sleep 0.25; n=$((n - 1)); done
    return 1
}
active() { [ "$(prop ActiveState)" = active ]; }
job_state() { trainguard status --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print({j['job']: j['state'] for j in d['jobs']}.get('$1',''))" 2>/dev/null; }

# A booted host has tracefs mounted by systemd (sys-kernel-tracing.mount); a container skips that
# unit, so mount it as the host's boot would (the agent's unit has no CAP_SYS_ADMIN to do it).
mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing 2>/res/tracefs.err
say tracefs "$(mountpoint -q /sys/kernel/tracing && echo mounted || cat /res/tracefs.err)"

# --- docs/service.md's install steps (the checkout and its .venv exist already) ---------------
ln -sf "$REPO/.venv/bin/trainguard" /usr/local/bin/trainguard
install -m 0644 "$REPO/agent/systemd/trainguard-agent.service" /etc/systemd/system/
mkdir -p /etc/trainguard
cat > /etc/trainguard/agent.toml <<'EOF'
[agent]
interval_s = 0.5
[checkpoint]
memory_every = 5
disk_every = 10
EOF
trainguard agent --check-config /etc/trainguard/agent.toml > /res/check-config.txt 2>&1
say check_config $?
# Test-only drop-in: a short watchdog, so a stalled loop is caught within seconds.
mkdir -p /etc/systemd/system/$unit.service.d
printf '[Service]\nWatchdogSec=4\n' > /etc/systemd/system/$unit.service.d/10-test.conf
# A checkout under /tmp (CI clones there) is hidden by the unit's PrivateTmp=; a real install is
# /opt/trainguard. Bind it into the unit's namespace, read-only, for the test.
case "$REPO" in /tmp/*) printf 'BindReadOnlyPaths=%s\n' "$REPO" >> /etc/systemd/system/$unit.service.d/10-test.conf ;; esac
# This checkout's interpreter may live under a home (pyenv in /root), which ProtectHome=yes hides.
case "$(readlink -f "$REPO/.venv/bin/python")" in /root/*|/home/*) printf 'ProtectHome=read-only\n' >> /etc/systemd/system/$unit.service.d/10-test.conf ;; esac
# A local user plants the memory tier's root first (a symlink to /etc): the unit must move it
# aside and make its own, never follow it.
shm_root=/dev/shm/trainguard-$("$REPO/.venv/bin/python" -c "from trainguard.agent.paths import agent_tag; print(agent_tag('/var/lib/trainguard'))")
setpriv --reuid=65534 --regid=65534 --clear-groups ln -s /etc "$shm_root"
say shm_planted "$(stat -c %u:%F "$shm_root")"
systemctl daemon-reload && systemctl enable --now $unit > /res/enable.txt 2>&1
say enable $?
wait_for 60 active
say active "$(prop ActiveState)"
if [ "$(prop ActiveState)" != active ]; then  # nothing below can work: say why and end
    journalctl -u $unit --no-pager -o cat > /res/journal.txt 2>&1
    systemctl status $unit --no-pager > /res/unit-status.txt 2>&1
    say done no
    systemctl poweroff
    exit 1
fi
wait_for 10 sh -c "[ -n \"\$(systemctl show -p StatusText --value $unit)\" ]"
say status_text "$(prop StatusText)"
say main_pid_1 "$(prop MainPID)"

# --- /dev/shm: read-only to the agent but for its memory root, which is its own ----------------
say shm_root "$(stat -c %u:%F:%a "$shm_root")"
say shm_moved_aside "$(ls -d "$shm_root".unsafe-* 2>/dev/null | wc -l)"
nsenter -t "$(prop MainPID)" -m touch /dev/shm/tg-probe 2>/res/shm-probe.err
say shm_write_elsewhere $?
nsenter -t "$(prop MainPID)" -m sh -c "touch '$shm_root/.probe' && rm '$shm_root/.probe'" 2>/res/shm-root-probe.err
say shm_write_root $?

# --- collectors under the unit's capability set ------------------------------------------------
trainguard status --json > /res/status.json 2>/res/status.err
say status_rc $?

# --- a job runs and writes its checkpoints and outputs ----------------------------------------
mkdir -p /srv/tg-out
chmod 0777 /srv/tg-out
trainguard run --detach --job svc --nproc 2 -- "$REPO/.venv/bin/python" "$REPO/examples/ddp_api.py" \
    --steps 30 --out /srv/tg-out/model.pt > /res/run.txt 2>&1
say run_rc $?
wait_for 180 sh -c "[ \"\$(trainguard status --json | python3 -c \"import json,sys; print({j['job']: j['state'] for j in json.load(sys.stdin)['jobs']}.get('svc',''))\")\" = succeeded ] || [ \"\$(trainguard status --json | python3 -c \"import json,sys; print({j['job']: j['state'] for j in json.load(sys.stdin)['jobs']}.get('svc',''))\")\" = failed ]"
say job_state "$(job_state svc)"
trainguard checkpoints --json > /res/checkpoints.json 2>&1
say output_written "$([ -s /srv/tg-out/model.pt ] && echo yes || echo no)"
cp /var/lib/trainguard/jobs/svc/rank0.log /res/rank0.log 2>/dev/null

# --- reload --------------------------------------------------------------------------------
systemctl reload $unit
say reload_rc $?
wait_for 10 sh -c "trainguard events --json 2>/dev/null | grep -q config_reloaded"
say reloaded "$(trainguard events --json 2>/dev/null | grep -c config_reloaded)"

# --- a stalled main loop: the watchdog kills it, Restart= brings it back -----------------------
pid1=$(prop MainPID)
kill -STOP "$pid1"
wait_for 30 sh -c "[ \"\$(systemctl show -p NRestarts --value $unit)\" -ge 1 ] && [ \"\$(systemctl show -p ActiveState --value $unit)\" = active ]"
say n_restarts "$(prop NRestarts)"
say main_pid_2 "$(prop MainPID)"
journalctl -u $unit --no-pager -o cat 2>/dev/null | grep -i -m3 "watchdog" > /res/watchdog.txt
say watchdog_logged "$(grep -ci watchdog /res/watchdog.txt)"
wait_for 30 active

# --- the agent SIGKILLed with a job running: Restart= brings it back, it adopts the ranks ------
trainguard run --detach --job adopt --nproc 2 -- "$REPO/.venv/bin/python" "$REPO/examples/ddp_api.py" \
    --steps 100000 --step-sleep 0.05 > /res/run-adopt.txt 2>&1
wait_for 60 sh -c "[ \"\$(trainguard status --json | python3 -c \"import json,sys; print({j['job']: j['state'] for j in json.load(sys.stdin)['jobs']}.get('adopt',''))\")\" = running ]"
rank_pids() { trainguard status --json | python3 -c "import json,sys; print(' '.join(str(r['pid']) for j in json.load(sys.stdin)['jobs'] if j['job']=='$1' for r in j['ranks']))"; }
before=$(rank_pids adopt)
restarts=$(prop NRestarts)
kill -KILL "$(prop MainPID)"
wait_for 30 sh -c "[ \"\$(systemctl show -p NRestarts --value $unit)\" -gt $restarts ] && [ \"\$(systemctl show -p ActiveState --value $unit)\" = active ]"
wait_for 30 sh -c "trainguard events --json 2>/dev/null | grep -q job_adopted"
say adopted "$(trainguard events --json 2>/dev/null | grep -c job_adopted)"
say adopt_pids_before "$before"
say adopt_pids_after "$(rank_pids adopt)"

# --- a job's secret: to its rank through a root-only file, never a command line -------------
secret="hf_svc_$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')"
printf '%s\n' "$secret" > /res/secret.pat
HF_TOKEN="$secret" trainguard run --detach --job sec-job --nproc 1 -- /bin/sh -c 'echo "token=$HF_TOKEN"; exec sleep 60' \
    > /res/run-sec.txt 2>&1
wait_for 60 sh -c "grep -q token= /var/lib/trainguard/jobs/sec-job/rank0.log 2>/dev/null"
say sec_reached "$(grep -cFf /res/secret.pat /var/lib/trainguard/jobs/sec-job/rank0.log 2>/dev/null)"
n=0
for f in /proc/[0-9]*/cmdline; do grep -qaFf /res/secret.pat "$f" 2>/dev/null && n=$((n + 1)); done
say sec_cmdlines "$n"
sunit='trainguard-sec\x2djob-a1-r0.service'
envdir='/run/trainguard/env/sec-job'
say sec_env_prop "$(systemctl show -p Environment --value "$sunit" | grep -cFf /res/secret.pat)"
say sec_env_file "$(stat -c '%a %U' "$envdir/a1-r0.env" 2>&1)"
say sec_slice "$(systemctl show -p Slice --value "$sunit")"
say sec_slice_parent "$(systemctl show -p Slice --value 'trainguard-sec\x2djob.slice')"
"$REPO/.venv/bin/python" -c "from trainguard.agent.api.client import ApiClient
ApiClient.local('/run/trainguard/agent.sock').stop_job('sec-job')" > /res/stop-sec.txt 2>&1
wait_for 30 sh -c "[ ! -e '$envdir' ]"
say sec_env_gone "$([ -e "$envdir" ] && echo no || echo yes)"

# --- ranks of launcher.user: transient units with User=, the job's directories handed over ----
printf '[launcher]\nuser = "nobody"\n' >> /etc/trainguard/agent.toml
# The rank user must reach the interpreter: a test machine's may sit under /root (a real install
# has it in /usr or /opt). The directories on the way are this container's own, so open them here.
d=$(dirname "$(readlink -f "$REPO/.venv/bin/python")")
while [ "$d" != / ]; do chmod o+x "$d" 2>/dev/null; d=$(dirname "$d"); done
trainguard agent --check-config /etc/trainguard/agent.toml > /res/check-config-user.txt 2>&1
restarts=$(prop NRestarts)
systemctl restart $unit
wait_for 60 active
say user_active "$(prop ActiveState)"
trainguard run --detach --job asuser --nproc 2 -- "$REPO/.venv/bin/python" "$REPO/examples/ddp_api.py" \
    --steps 100000 --step-sleep 0.05 > /res/run-asuser.txt 2>&1
wait_for 90 sh -c "[ \"\$(trainguard status --json | python3 -c \"import json,sys; print({j['job']: j['state'] for j in json.load(sys.stdin)['jobs']}.get('asuser',''))\")\" = running ]"
say user_state "$(job_state asuser)"
upids=$(rank_pids asuser)
say user_pids "$upids"
# /proc/PID is owned by the process's effective uid (and awk is an /etc/alternatives link, absent here).
say user_uids "$(for p in $upids; do stat -c %u "/proc/$p"; done | sort -u | tr '\n' ' ')"
say user_unit_user "$(systemctl show -p User --value 'trainguard-asuser-a1-r0.service')"
wait_for 60 sh -c "trainguard checkpoints --json --job asuser 2>/dev/null | grep -q '\"memory\"'"
say user_memory_ckpt "$(trainguard checkpoints --json --job asuser 2>/dev/null | grep -c '\"memory\"')"
cp /var/lib/trainguard/jobs/asuser/rank0.log /res/asuser-rank0.log 2>/dev/null
"$REPO/.venv/bin/python" -c "from trainguard.agent.api.client import ApiClient
ApiClient.local('/run/trainguard/agent.sock').stop_job('asuser')" > /res/stop-asuser.txt 2>&1
wait_for 30 sh -c "[ \"\$(trainguard status --json | python3 -c \"import json,sys; print({j['job']: j['state'] for j in json.load(sys.stdin)['jobs']}.get('asuser',''))\")\" = stopped ]"
say user_stopped "$(job_state asuser)"

# --- stop with a job running: its ranks go too ---------------------------------------------
trainguard run --detach --job long --nproc 2 -- "$REPO/.venv/bin/python" "$REPO/examples/ddp_api.py" \
    --steps 100000 --step-sleep 0.05 > /res/run-long.txt 2>&1
wait_for 60 sh -c "[ \"\$(trainguard status --json | python3 -c \"import json,sys; print({j['job']: j['state'] for j in json.load(sys.stdin)['jobs']}.get('long',''))\")\" = running ]"
pids="$(rank_pids long) $(rank_pids adopt)"
say long_pids "$pids"
# Each rank is a transient unit of its own in the job's slice, outside the agent's cgroup.
say rank_units "$(systemctl list-units --plain --no-legend 'trainguard-long-*' | grep -c running)"
first=$(echo $pids | cut -d' ' -f1)
say rank_cgroup "$(grep '^0::' /proc/$first/cgroup | cut -d: -f3)"
systemctl stop $unit
say stop_rc $?
left=0
for p in $pids; do [ -d "/proc/$p" ] && left=$((left + 1)); done
say ranks_left "$left"
journalctl -u $unit --no-pager -o cat > /res/journal.txt 2>&1
say done yes
systemctl poweroff
