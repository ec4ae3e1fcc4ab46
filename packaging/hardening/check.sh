#!/bin/bash
# packaging/hardening/check.sh: try moed.service's sandbox directives against
# the real daemon on a machine without systemd, one at a time and then all
# together, by building each one's effect by hand (namespaces, mounts, a
# cgroup, setpriv, seccomp). For every case moed starts with --demo, serves a
# checked forward pass and a checked grouped GEMM through moectl from outside
# the sandbox, and stops with exit status 0 on SIGTERM.
#
#   packaging/hardening/check.sh BACKEND MOED MOECTL SECCOMP_EXEC ALLOWLIST
#
# BACKEND is cpu or cuda. ALLOWLIST holds the x86-64 numbers of the system
# calls that SystemCallFilter=@system-service with ~@privileged leaves (see
# syscalls.py). Needs root. Prints one line per case:
#   PASS|FAIL|SKIP <case> (<directives>): <what happened>
# A case marked [left out of moed.service ...] is a directive the unit does
# not set; with CUDA its failure is the reason.
set -u
backend=$1 moed=$(readlink -f "$2") moectl=$(readlink -f "$3") sx=$(readlink -f "$4")
allow=$(readlink -f "$5")
base=/run/moed-hcheck
nobody=65534
# The sandbox hides /tmp and /home, where a build may live: run copies.
mkdir -p "$base/bin"
cp "$moed" "$sx" "$allow" "$base/bin/"
moed=$base/bin/$(basename "$moed") sx=$base/bin/$(basename "$sx") allow=$base/bin/$(basename "$allow")
chmod -R a+rX "$base"

# DeviceAllow= of moed.service, as cgroup v1 device rules.
device_rules() {
    for d in 1:3 1:5 1:7 1:8 1:9; do echo "c $d rwm"; done    # DevicePolicy=closed
    for name in nvidiactl nvidia-frontend nvidia-uvm nvidia-caps; do
        awk -v n="$name" '$2 == n { print "c " $1 ":* rw" }' /proc/devices
    done
    for p in /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do
        [ -c "$p" ] && printf 'c %d:%d rw\n' "0x$(stat -c %t "$p")" "0x$(stat -c %T "$p")"
    done
    true
}

# ProtectSystem=strict, ProtectHome=yes, PrivateTmp=yes,
# ProtectKernelTunables=yes: everything read-only but /dev, /proc, /sys and
# the runtime directory; empty /home, /root, /tmp; /proc/sys and /sys
# read-only. Run inside a new mount namespace; $1 is the runtime directory.
fs_setup='
set -e
rt=$1; shift
mount --make-rprivate /
mount --bind "$rt" "$rt"
for mp in $(awk "{print \$5}" /proc/self/mountinfo | sort -u); do
    case $mp in /dev|/dev/*|/proc|/proc/*|/sys|/sys/*) continue;; esac
    mount -o remount,bind,ro "$mp" 2>/dev/null || true
done
mount -t tmpfs -o mode=0755 tmpfs /home
mount -t tmpfs -o mode=0700 tmpfs /root
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -o remount,bind,rw "$rt"
mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys
mount --bind /sys /sys && mount -o remount,bind,ro /sys
[ "$1" = --procsubset ] && { shift; mount -t proc -o subset=pid,hidepid=invisible proc /proc; }
exec "$@"'

# PrivateDevices=yes: a /dev with only the pseudo devices.
privdev_setup='
set -e
mount --make-rprivate /
mount -t tmpfs -o mode=0755 tmpfs /dev
for d in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
    IFS=: read -r n ma mi <<EOF
$d
EOF
    mknod -m 0666 /dev/$n c $ma $mi
done
mkdir /dev/shm /dev/pts && mount -t tmpfs -o mode=1777 tmpfs /dev/shm
exec "$@"'

# ProcSubset=pid: a /proc of processes only.
procsubset_setup='
set -e
mount --make-rprivate /
mount -t proc -o subset=pid,hidepid=invisible proc /proc
exec "$@"'

# run_case NAME "DIRECTIVES" EXPECT(pass|fail) PROBE WRAPPER...: the wrapper
# words come before "moed ARGS"; @RT@ in them is the runtime directory. PROBE
# is a shell command run under the same wrapper first: it exits 0 only if
# the restriction is in effect, so a case cannot pass by emulating nothing.
run_case() {
    local name=$1 what=$2 expect=$3 probe=$4; shift 4
    local rt=$base/$name log=$base/$name.log
    rm -rf "$rt" && mkdir -p "$rt" && chown $nobody:$nobody "$rt" && chmod 0750 "$rt"
    local cmd=()
    for w in "$@"; do cmd+=("${w//@RT@/$rt}"); done
    if ! "${cmd[@]}" sh -c "$probe" >"$log" 2>&1; then
        echo "FAIL $name ($what): the emulation is not in effect (probe: $probe)"
        sed 's/^/    | /' "$log" | tail -n 4
        return
    fi
    "${cmd[@]}" "$moed" --demo --runtime-dir "$rt" --backend "$backend" >"$log" 2>&1 &
    local pid=$! ok=0 why=""
    for _ in $(seq 200); do
        "$moectl" -r "$rt" info >/dev/null 2>&1 && { ok=1; break; }
        kill -0 $pid 2>/dev/null || break
        sleep 0.1
    done
    if [ $ok = 1 ]; then
        "$moectl" -r "$rt" forward --layer demo --tokens 16 --check >>"$log" 2>&1 &&
            "$moectl" -r "$rt" gemm --layer demo-gemm --rows 50 --check >>"$log" 2>&1 || {
            ok=0; why="a checked request failed"; }
        [ $ok = 1 ] && ! grep -q "backend $backend" "$log" && { ok=0; why="not on the $backend backend"; }
        kill -TERM $pid; wait $pid; local st=$?
        [ $ok = 1 ] && [ $st != 0 ] && { ok=0; why="exit status $st after SIGTERM"; }
    else
        kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null
        why="did not start: $(grep -m1 -E 'error|cannot|denied|fail' "$log" | cut -c1-160)"
    fi
    local verdict
    if [ $ok = 1 ]; then verdict=PASS; why="served checked requests, exit 0"
    else verdict=FAIL; fi
    [ "$expect" = fail ] && why="$why [left out of moed.service for CUDA's sake]"
    echo "$verdict $name ($what): $why"
    if [ $ok = 0 ] && [ "$expect" = pass ]; then sed 's/^/    | /' "$log" | tail -n 8; fi
}

# DevicePolicy= needs the cgroup v1 devices controller here (systemd itself
# uses a BPF program on cgroup v2, which this script does not build).
cg=""
if [ -f /sys/fs/cgroup/devices/devices.allow ]; then
    cg=/sys/fs/cgroup/devices/moed-hcheck
    mkdir -p $cg && echo a > $cg/devices.deny && device_rules > $base/rules &&
        while read -r r; do echo "$r" > $cg/devices.allow; done < $base/rules || cg=""
fi

echo "# moed hardening check: backend $backend, kernel $(uname -r)"
echo "# nvidia in /proc/devices: $(grep -i nvidia /proc/devices | tr '\n' ' ')"
echo "# /dev/nvidia*: $(ls /dev/nvidia* 2>/dev/null | tr '\n' ' ')"
setpriv_drop=(setpriv --reuid=$nobody --regid=$nobody --clear-groups)
nnp=(--no-new-privs --bounding-set=-all --inh-caps=-all)
py=$(command -v python3)
run_case baseline "none" pass true env
run_case user "User= (an unprivileged uid)" pass '[ "$(id -u)" = '$nobody' ]' "${setpriv_drop[@]}"
run_case nnp-caps "User=, NoNewPrivileges=yes, CapabilityBoundingSet=" pass \
    'grep -q "^NoNewPrivs:.1" /proc/self/status && grep -q "^CapBnd:.0000000000000000" /proc/self/status' \
    "${setpriv_drop[@]}" "${nnp[@]}"
run_case privnet "PrivateNetwork=yes" pass '[ $(wc -l < /proc/self/net/dev) = 3 ]' unshare -n
run_case fs "ProtectSystem=strict ProtectHome=yes PrivateTmp=yes ProtectKernelTunables=yes" pass \
    '! touch /etc/.moed-probe 2>/dev/null && ! touch /usr/.moed-probe 2>/dev/null && [ -z "$(ls -A /tmp)$(ls -A /home)$(ls -A /root)" ] && ! touch /proc/sys/kernel/domainname 2>/dev/null' \
    unshare -m sh -c "$fs_setup" fs @RT@
run_case mdwe "MemoryDenyWriteExecute=yes (systemd's seccomp rules)" pass \
    "! $py -c 'import mmap; mmap.mmap(-1, 4096, prot=7)' 2>/dev/null" "$sx" --mdwe --
run_case syscalls "SystemCallFilter=@system-service ~@privileged, SystemCallArchitectures=native" \
    pass "! $py -c 'import os; os.chroot(\"/\")' 2>/dev/null" "$sx" --allow "$allow" --
run_case afunix "RestrictAddressFamilies=AF_UNIX" pass \
    "! $py -c 'import socket; socket.socket(socket.AF_INET)' 2>/dev/null" "$sx" --af-unix --
if [ -n "$cg" ]; then
    run_case devices "DevicePolicy=closed + DeviceAllow= ($(wc -l < $base/rules) rules)" pass \
        '! dd if=/dev/kmsg count=0 status=none 2>/dev/null && dd if=/dev/null count=0 status=none' \
        sh -c 'echo $$ > '"$cg"'/cgroup.procs && exec "$@"' cg
else
    echo "SKIP devices (DevicePolicy=closed + DeviceAllow=): no writable cgroup v1 devices controller"
fi
# These two run as the unprivileged user too: as root, libcuda recreates
# missing /dev/nvidia* nodes itself. PrivateDevices= is left out of the unit:
# it hides the GPU.
run_case procsubset "ProcSubset=pid ProtectProc=invisible, User=, NoNewPrivileges=yes" pass '[ ! -e /proc/cpuinfo ]' \
    unshare -m sh -c "$procsubset_setup" ps "${setpriv_drop[@]}" "${nnp[@]}"
run_case privdev "PrivateDevices=yes, User=, NoNewPrivileges=yes" fail '[ ! -e /dev/kmsg ]' \
    unshare -m sh -c "$privdev_setup" pd "${setpriv_drop[@]}" "${nnp[@]}"
# As moed.service has them.
all=(unshare -n -m sh -c "$fs_setup" fs @RT@ --procsubset "${setpriv_drop[@]}" "${nnp[@]}"
     "$sx" --mdwe --allow "$allow" --af-unix --)
[ -n "$cg" ] && all=(sh -c 'echo $$ > '"$cg"'/cgroup.procs && exec "$@"' cg "${all[@]}")
run_case all "the directives of moed.service together" pass \
    '[ "$(id -u)" = '$nobody' ] && ! touch /etc/.moed-probe 2>/dev/null && [ ! -e /proc/cpuinfo ] && [ $(wc -l < /proc/self/net/dev) = 3 ]' \
    "${all[@]}"
[ -n "$cg" ] && { echo $$ > /sys/fs/cgroup/devices/cgroup.procs; rmdir $cg 2>/dev/null; }
rm -rf "$base"
