#!/usr/bin/env bash
# rxe-pair, in each VM: the COMMAND that scripts/rxe-pair asks scripts/rxe-vm to run (as root,
# chrooted into the host's root, in the host's current directory, rxe0 ACTIVE on eth0).
# Arguments: the side's own command. Environment: RXE_PAIR_SIDE, RXE_PAIR_CTL, ... (see rxe-pair).
#
#  1. start barrier: writes CTL/ready.SIDE, waits for CTL/go (the host writes it once both VMs
#     are ready), so both commands start together;
#  2. runs the command in a session of its own (setsid: kill-cmd signals its whole process group),
#     stdin /dev/null, stdout+stderr as this script's (the VM's output stream);
#  3. meanwhile a fault agent polls CTL/inbox.SIDE for requests ID.cmd (verb and arguments, one
#     per line) that the host forwards, applies them to eth0 / the command, and answers in
#     ID.res: "ok|error N", then N lines (a one-line message, then details). The host deletes
#     both files. The agent runs only builtins besides the fault's own tc/ip: every exec costs
#     0.1-0.4 s in these guests (binaries and libraries come over 9p, under TCG);
#  4. when the command ends: writes "exit N" to CTL/status.SIDE and exits with N (which rxe-vm
#     passes on).
set -euo pipefail

side=${RXE_PAIR_SIDE:?not started by scripts/rxe-pair} ctl=${RXE_PAIR_CTL:?not started by scripts/rxe-pair}
inbox=$ctl/inbox.$side
state=/run/rxe-pair # guest-local tmpfs
dev=eth0
mkdir -p "$state"
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd # for <(...): devtmpfs has no /dev/fd
exec {log_fd}>&2
say() { echo "rxe-pair[$side]: $*" >&"$log_fd"; }

nap_fd=''
nap() { # sleep without an exec: read with a timeout from a pipe nobody writes to
	[ -n "$nap_fd" ] || exec {nap_fd}<> <(:)
	read -r -t "$1" -u "$nap_fd" _ || true
}

# ---- faults ---------------------------------------------------------------------------------------
# A fresh root netem qdisc with exactly the given settings. `tc qdisc replace` with the handle in
# use would *change* the qdisc, keeping settings not named again (corrupt 1% survives a later
# `netem delay 20ms`); a different handle grafts a new one in its place, atomically. The kernel
# refuses that graft while the old one duplicates packets: then delete it first.
netem_set() {
	local h=0 err
	[ ! -s "$state/handle" ] || read -r h <"$state/handle"
	h=$((h % 2 + 1))
	if ! err=$(tc qdisc replace dev "$dev" root handle "$h": netem "$@" 2>&1); then
		case $err in
		*"cannot mix duplicating netems"*)
			tc qdisc del dev "$dev" root 2>/dev/null
			tc qdisc add dev "$dev" root handle "$h": netem "$@" 2>&1 || return 1
			;;
		*) printf '%s\n' "$err"; return 1 ;;
		esac
	fi
	echo "$h" >"$state/handle"
}

# shellcheck disable=SC2317 # invoked indirectly (later)
restore_netem() { # the netem setting saved by the last `netem` fault, or none
	local args=()
	if [ -s "$state/netem" ]; then # saved by the last `netem` fault; empty after `clear`
		mapfile -t args <"$state/netem"
		netem_set "${args[@]}"
	else
		tc qdisc del dev "$dev" root 2>/dev/null || true
	fi
}

later() { # SECONDS MESSAGE COMMAND...: run COMMAND after SECONDS, in the background
	local s=$1 msg=$2
	shift 2
	(
		sleep "$s"
		if "$@"; then say "$msg"; else say "FAILED: $msg"; fi
	) </dev/null >&"$log_fd" 2>&1 &
}

seconds_re='^[0-9]+([.][0-9]+)?$'
apply() { # VERB ARG...: prints a one-line message (then details); fails if the fault failed
	local verb=${1:-} pid sig stats
	shift || true
	case $verb in
	netem)
		[ $# -gt 0 ] || { echo "netem needs arguments (e.g. loss 5%)"; return 1; }
		netem_set "$@" || return 1
		printf '%s\n' "$@" >"$state/netem"
		echo "$dev: netem $*"
		;;
	clear)
		stats=$(tc -s qdisc show dev "$dev" 2>/dev/null |
			sed -n '/^qdisc netem/{n;s/^ *Sent [0-9]* bytes \([0-9]*\) pkt (dropped \([0-9]*\),.*/sent \1 pkt, dropped \2/p;q}')
: >"$state/netem"
		tc qdisc del dev "$dev" root 2>/dev/null || true
		ip link set "$dev" up 2>&1 || return 1
		echo "$dev: no netem${stats:+ (it had $stats)}, link up"
		;;
	link)
		case ${1:-} in
		up)
			ip link set "$dev" up 2>&1 || return 1
			echo "$dev up"
			;;
		down)
			if [ -n "${2:-}" ] && ! [[ $2 =~ $seconds_re ]]; then echo "link down [SECONDS]: bad '$2'"; return 1; fi
			ip link set "$dev" down 2>&1 || return 1
			[ -z "${2:-}" ] || later "$2" "$dev up again after ${2}s" ip link set "$dev" up
			echo "$dev down${2:+ for ${2}s}"
			;;
		*) echo "link up|down [SECONDS]"; return 1 ;;
		esac
		;;
	partition)
		[[ ${1:-} =~ $seconds_re ]] || { echo "partition SECONDS"; return 1; }
		netem_set loss 100% || return 1
		later "$1" "partition over after ${1}s" restore_netem
		echo "$dev drops everything it sends for ${1}s"
		;;
	kill-cmd)
		sig=${1:-KILL}
		pid=$cmd_pid
		kill -0 "$pid" 2>/dev/null || { echo "the command (pid $pid) has ended"; return 1; }
		kill -s "$sig" -- "-$pid" 2>/dev/null || kill -s "$sig" "$pid" 2>&1 || return 1
		echo "sent SIG${sig#SIG} to the command (process group $pid)"
		;;
	run)
		[ $# -gt 0 ] || { echo "run needs a command"; return 1; }
		local out rc=0
		out=$("$@" 2>&1) || rc=$?
		echo "$* exited with status $rc"
		[ -z "$out" ] || printf '%s\n' "$out"
		return $rc
		;;
	*)
		echo "unknown verb '$verb'"
		return 1
		;;
	esac
}

agent() {
	set +e
	local f id args out lines st
	local -A seen=()
	while [ ! -e "$state/stop" ]; do
		for f in "$inbox"/*.cmd; do # renamed into place by the host: complete
			[ -e "$f" ] || continue
			id=${f##*/}
			id=${id%.cmd}
			[ -z "${seen[$id]:-}" ] || continue # answered; the host has not removed it yet
			seen[$id]=1
			mapfile -t args <"$f"
			if out=$(apply "${args[@]}" 2>&1); then st=ok; else st=error; fi
			[ -n "$out" ] || out=$st
			mapfile -t lines <<<"$out"
			say "fault ${args[*]}: $st: ${lines[0]}"
			printf '%s\n' "$st ${#lines[@]}" "${lines[@]}" >"$inbox/$id.res"
		done
		nap 0.2
	done
}

# ---- run ------------------------------------------------------------------------------------------
: >"$ctl/ready.$side"
until [ -e "$ctl/go" ]; do nap 0.1; done
[ "${RXE_PAIR_STAGGER:-0}" = 0 ] || nap "$RXE_PAIR_STAGGER" # rxe-pair --stagger, on B

setsid "$@" </dev/null &
cmd_pid=$!
agent </dev/null &
agent_pid=$!
rc=0
wait "$cmd_pid" 2>/dev/null || rc=$? # (2>/dev/null: no "Killed" job notice from bash)
[ "$rc" -le 128 ] || say "the command died of signal $((rc - 128))"
# Let the agent answer the request in progress (the kill-cmd that ended the command, say), then
# stop it; the status file comes after, so the host sees the answer first.
: >"$state/stop"
for ((i = 0; i < 50; i++)); do
	kill -0 "$agent_pid" 2>/dev/null || break
	nap 0.1
done
kill "$agent_pid" 2>/dev/null || true
wait "$agent_pid" 2>/dev/null || true
printf 'exit %d\n' "$rc" >"$ctl/status.$side" # one short write: complete when it appears
exit "$rc"
