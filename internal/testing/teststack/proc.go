package teststack

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
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
