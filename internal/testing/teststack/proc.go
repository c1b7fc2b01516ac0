package teststack

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// Descendants returns the pids of root's descendants (children first, then
// theirs), read from /proc: the processes a test freezes or kills with a
// daemon (sshd's session processes, a lab host's daemons, which share the
// caller's pid namespace).
func Descendants(root int) []int {
	children := map[int][]int{}
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, f := range stats {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		s := string(b)
		i := strings.LastIndexByte(s, ')') // the command name may hold spaces and ')'
		if i < 0 {
			continue
		}
		fields := strings.Fields(s[i+1:])
		if len(fields) < 2 {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(f)))
		ppid, _ := strconv.Atoi(fields[1])
		children[ppid] = append(children[ppid], pid)
	}
	var out []int
	for todo := children[root]; len(todo) > 0; {
		pid := todo[0]
		todo = append(todo[1:], children[pid]...)
		out = append(out, pid)
	}
	return out
}

// FreezeSSHD stops (SIGSTOP) the sshd of the stack in stackDir, read from
// its pid file (what `scripts/teststack sshd-pid` reads), and then every
// process under it (the sessions carrying the library's connections),
// until none is left running in its tree. It returns the pids it stopped,
// the listener first, and thaw, which resumes them (SIGCONT) and does
// nothing after its first call. On error nothing is stopped and thaw is a
// no-op.
func FreezeSSHD(stackDir string) (thaw func(), frozen []int, err error) {
	pidFile := filepath.Join(stackDir, "ssh", "sshd.pid")
	b, err := os.ReadFile(pidFile)
	if err != nil {
		return func() {}, nil, fmt.Errorf("sshd pid: %w", err)
	}
	listener, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || listener <= 1 {
		return func() {}, nil, fmt.Errorf("sshd pid file %s holds %q", pidFile, b)
	}
	if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", listener)); err != nil || strings.TrimSpace(string(comm)) != "sshd" {
		return func() {}, nil, fmt.Errorf("pid %d from %s is not a running sshd (comm %q, %v)", listener, pidFile, comm, err)
	}
	stop := func(pid int) {
		if pid == os.Getpid() || slices.Contains(frozen, pid) {
			return
		}
		frozen = append(frozen, pid)
		_ = syscall.Kill(pid, syscall.SIGSTOP)
	}
	// The listener first, so that no session starts meanwhile.
	stop(listener)
	for {
		n := len(frozen)
		for _, pid := range Descendants(listener) {
			stop(pid)
		}
		if len(frozen) == n {
			break
		}
	}
	var once sync.Once
	thaw = func() {
		once.Do(func() {
			for _, pid := range frozen {
				_ = syscall.Kill(pid, syscall.SIGCONT)
			}
		})
	}
	return thaw, frozen, nil
}
