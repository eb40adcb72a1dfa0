#!/usr/bin/env bash
# The command `scripts/rxe-pair --self-test` runs on both VMs (it branches on RXE_PAIR_SIDE):
#   0. rxe0 is ACTIVE on eth0 and the peer answers ping;
#   1. rping, A server / B client, 5 pings;
#   2. rping, B server / A client, 5 pings;
#   3. A asks for `B netem loss 10%` (through the host: the cross-VM fault path), then rping
#      A server / B client, 20 pings, which RC retransmission must complete; then B asks for
#      `B clear`, whose answer must report dropped packets.
# Each round prints one line; full rping output goes to $RXE_PAIR_OUT/selftest.SIDE.log.
# Exit status 0 if everything worked.
set -euo pipefail

side=${RXE_PAIR_SIDE:?run by scripts/rxe-pair --self-test} self=$RXE_PAIR_SELF peer=$RXE_PAIR_PEER
log=$RXE_PAIR_OUT/selftest.$side.log
: >"$log"
t0=$EPOCHREALTIME
say() { echo "self-test $side: $*"; }
fail() {
	say "FAILED: $*"
	echo "---- last lines of $log ----"
	tail -n 15 "$log"
	exit 1
}
secs() { # seconds since $1 ($EPOCHREALTIME), one decimal
	local a=${1/[.,]/} b=${EPOCHREALTIME/[.,]/}
	local d=$(((b - a) / 100000))
	printf '%d.%d' $((d / 10)) $((d % 10))
}

# rping's verbose mode prints one "ping data" line per ping on each side.
server() { # COUNT: serve one client; succeed if it did COUNT pings
	echo "== rping server, $1 pings" >>"$log"
	rping -s -a "$self" -C "$1" -v >"$log.part" 2>&1 || { cat "$log.part" >>"$log"; return 1; }
	local n
	n=$(grep -c 'ping data' "$log.part" || true)
	cat "$log.part" >>"$log"
	rm -f "$log.part"
	[ "$n" -eq "$1" ] || { echo "server: $n pings instead of $1" >>"$log"; return 1; }
}
client() { # COUNT: connect to the peer's server (retrying until it listens), do COUNT pings
	local i n
	echo "== rping client, $1 pings" >>"$log"
	for ((i = 0; i < 30; i++)); do
		if rping -c -a "$peer" -C "$1" -v >"$log.part" 2>&1; then
			n=$(grep -c 'ping data' "$log.part" || true)
			cat "$log.part" >>"$log"
			rm -f "$log.part"
			[ "$n" -eq "$1" ] || { echo "client: $n pings instead of $1" >>"$log"; return 1; }
			return 0
		fi
		cat "$log.part" >>"$log" # most likely rejected: the server is not listening yet
		sleep 1
	done
	echo "client: no connection after $i attempts" >>"$log"
	return 1
}
round() { # N DESCRIPTION COMMAND...
	local n=$1 what=$2 t
	shift 2
	t=$EPOCHREALTIME
	"$@" || fail "round $n ($what)"
	say "round $n ($what): ok in $(secs "$t") s"
}

# 0
rdma link show rxe0/1 | grep -q 'state ACTIVE.*netdev eth0' || fail "rxe0 not ACTIVE on eth0: $(rdma link show 2>&1)"
ping -c 2 -W 5 "$peer" >>"$log" 2>&1 || fail "ping $peer"
say "rxe0 ACTIVE on eth0 at $self, ping $peer ok"

# 1, 2
if [ "$side" = A ]; then
	round 1 "rping A server, B client, 5 pings" server 5
	round 2 "rping B server, A client, 5 pings" client 5
else
	round 1 "rping A server, B client, 5 pings" client 5
	round 2 "rping B server, A client, 5 pings" server 5
fi

# 3
if [ "$side" = A ]; then
	t=$EPOCHREALTIME
	answer=$("$RXE_PAIR" fault B netem loss 10%) || fail "fault request 'B netem loss 10%'"
	say "fault B netem loss 10% requested from A: '$answer' after $(secs "$t") s"
	round 3 "rping A server, B client, 20 pings, B drops 10%" server 20
else
	round 3 "rping A server, B client, 20 pings, B drops 10%" client 20
	answer=$("$RXE_PAIR" fault B clear) || fail "fault request 'B clear'"
	say "fault B clear: '$answer'"
	if ! [[ $answer =~ dropped\ ([0-9]+) ]] || [ "${BASH_REMATCH[1]}" -eq 0 ]; then
		fail "netem on B dropped nothing: '$answer'"
	fi
	rdma statistic show link rxe0/1 >>"$log" 2>&1 || true
fi
say "all rounds passed in $(secs "$t0") s"
