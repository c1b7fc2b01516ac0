package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// sample is one series of a Prometheus text exposition: its name, labels
// and value.
type sample struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// parseExposition reads the Prometheus text format (comments and blank
// lines skipped). A line it cannot read is an error naming it.
func parseExposition(r io.Reader) ([]sample, error) {
	var out []sample
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		s, err := parseSample(line)
		if err != nil {
			return nil, fmt.Errorf("exposition line %d: %w", n, err)
		}
		out = append(out, s)
	}
	return out, sc.Err()
}

func parseSample(line string) (sample, error) {
	s := sample{Labels: map[string]string{}}
	i := strings.IndexAny(line, "{ ")
	if i <= 0 {
		return s, fmt.Errorf("no value in %q", line)
	}
	s.Name, line = line[:i], line[i:]
	if line[0] == '{' {
		line = line[1:]
		for {
			line = strings.TrimLeft(line, " ,")
			if strings.HasPrefix(line, "}") {
				line = line[1:]
				break
			}
			eq := strings.Index(line, "=\"")
			if eq <= 0 {
				return s, fmt.Errorf("bad labels in %q", s.Name)
			}
			key := line[:eq]
			line = line[eq+2:]
			var val strings.Builder
			closed := false
			for j := 0; j < len(line); j++ {
				c := line[j]
				if c == '\\' && j+1 < len(line) {
					j++
					switch line[j] {
					case 'n':
						val.WriteByte('\n')
					default:
						val.WriteByte(line[j])
					}
					continue
				}
				if c == '"' {
					line, closed = line[j+1:], true
					break
				}
				val.WriteByte(c)
			}
			if !closed {
				return s, fmt.Errorf("unterminated label value in %q", s.Name)
			}
			s.Labels[key] = val.String()
		}
	}
	fields := strings.Fields(line)
	if len(fields) == 0 {
		return s, fmt.Errorf("no value for %q", s.Name)
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return s, fmt.Errorf("value of %q: %w", s.Name, err)
	}
	s.Value = v
	return s, nil
}

// scrape reads addr's /metrics.
func scrape(ctx context.Context, addr string) ([]sample, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	return parseExposition(resp.Body)
}

// sumBy sums the values of the series named name by the value of label
// ("" sums them all under "").
func sumBy(ss []sample, name, label string) map[string]float64 {
	out := map[string]float64{}
	for _, s := range ss {
		if s.Name == name {
			out[s.Labels[label]] += s.Value
		}
	}
	return out
}

// value is the sum of the series named name.
func value(ss []sample, name string) float64 { return sumBy(ss, name, "")[""] }

// procStat is a process's CPU time so far (user+system) and its RSS.
type procStat struct {
	At  time.Time
	CPU time.Duration
	RSS int64 // bytes
}

// clockTick is the kernel's USER_HZ (getconf CLK_TCK; 100 when unknown).
var clockTick = func() float64 {
	out, err := exec.Command("getconf", "CLK_TCK").Output()
	if v, err2 := strconv.ParseFloat(strings.TrimSpace(string(out)), 64); err == nil && err2 == nil && v > 0 {
		return v
	}
	return 100
}()

// readProc reads pid's CPU time from /proc/PID/stat (fields 14 and 15,
// utime and stime, after the command's parenthesis) and its RSS from
// /proc/PID/status (VmRSS).
func readProc(pid int) (procStat, error) {
	st := procStat{At: time.Now()}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return st, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return st, fmt.Errorf("/proc/%d/stat: no command", pid)
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3 (state)
	if len(f) < 13 {
		return st, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	ut, err1 := strconv.ParseFloat(f[11], 64)
	stt, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return st, fmt.Errorf("/proc/%d/stat: utime %q stime %q", pid, f[11], f[12])
	}
	st.CPU = time.Duration((ut + stt) / clockTick * float64(time.Second))
	b, err = os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return st, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				return st, fmt.Errorf("/proc/%d/status: VmRSS %q", pid, rest)
			}
			st.RSS = kb << 10
		}
	}
	return st, nil
}

// loadAvg is /proc/loadavg's first three fields.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
