package main

import (
	"bufio"
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// cpuProfile is the summary of one CPU profile of a fetch child: the
// flat time of its functions grouped by what they do.
type cpuProfile struct {
	duration, samples float64            // seconds of wall time profiled, seconds of CPU sampled
	groups            map[string]float64 // group -> flat seconds
	top               []profFunc         // the heaviest functions by flat time
}

type profFunc struct {
	name      string
	flat, cum float64 // seconds
}

// profGroups classify a function by its name, first match wins (hashing
// before the generic crypto of the SSH cipher, copies before the runtime).
var profGroups = []struct {
	name string
	re   *regexp.Regexp
}{
	{"hashing (sha256)", regexp.MustCompile(`sha256`)},
	{"SSH cipher and MAC", regexp.MustCompile(`crypto/|golang\.org/x/crypto|chacha20|poly1305|aes|gcm|ghash`)},
	{"copies (memmove, buffers)", regexp.MustCompile(`memmove|memclr|^io\.|^bufio\.|^bytes\.`)},
	{"libvirt RPC (go-libvirt, XDR)", regexp.MustCompile(`go-libvirt|xdr`)},
	{"syscalls and network", regexp.MustCompile(`^syscall\.|internal/poll|^net\.|runtime/internal/syscall|internal/runtime/syscall`)},
	{"Go runtime (GC, scheduler)", regexp.MustCompile(`^runtime\.|^internal/runtime`)},
}

func profGroup(fn string) string {
	for _, g := range profGroups {
		if g.re.MatchString(fn) {
			return g.name
		}
	}
	return "other"
}

var (
	profDuration = regexp.MustCompile(`Duration: ([0-9.]+)(ms|s|mins|hrs), Total samples = ([0-9.]+)(ms|s|mins|hrs)`)
	profLine     = regexp.MustCompile(`^\s*([0-9.]+)(ms|s|us|mins|hrs)\s+[0-9.]+%\s+[0-9.]+%\s+([0-9.]+)(ms|s|us|mins|hrs)\s+[0-9.]+%\s+(.+)$`)
)

func secs(v, unit string) float64 {
	f, _ := strconv.ParseFloat(v, 64)
	switch unit {
	case "us":
		return f / 1e6
	case "ms":
		return f / 1e3
	case "mins":
		return f * 60
	case "hrs":
		return f * 3600
	}
	return f
}

// parseTop reads `go tool pprof -top` output.
func parseTop(out string) (*cpuProfile, error) {
	p := &cpuProfile{groups: map[string]float64{}}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		l := sc.Text()
		if m := profDuration.FindStringSubmatch(l); m != nil {
			p.duration, p.samples = secs(m[1], m[2]), secs(m[3], m[4])
			continue
		}
		m := profLine.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		f := profFunc{name: strings.TrimSpace(m[5]), flat: secs(m[1], m[2]), cum: secs(m[3], m[4])}
		p.groups[profGroup(f.name)] += f.flat
		p.top = append(p.top, f)
	}
	if p.samples == 0 && len(p.top) == 0 {
		return nil, fmt.Errorf("no samples in pprof output: %.200s", out)
	}
	sort.SliceStable(p.top, func(i, j int) bool { return p.top[i].flat > p.top[j].flat })
	return p, nil
}

// summariseProfile runs `go tool pprof -top` on a CPU profile file.
func summariseProfile(ctx context.Context, path string) (*cpuProfile, error) {
	out, err := exec.CommandContext(ctx, "go", "tool", "pprof", "-top", "-nodecount=300", path).Output()
	if err != nil {
		return nil, fmt.Errorf("go tool pprof -top %s: %w", path, err)
	}
	return parseTop(string(out))
}

// groupsLine renders the groups by share of the samples, largest first.
func (p *cpuProfile) groupsLine() string {
	type kv struct {
		k string
		v float64
	}
	var gs []kv
	for k, v := range p.groups {
		gs = append(gs, kv{k, v})
	}
	sort.Slice(gs, func(i, j int) bool { return gs[i].v > gs[j].v || (gs[i].v == gs[j].v && gs[i].k < gs[j].k) })
	var s []string
	for _, g := range gs {
		pct := 0.0
		if p.samples > 0 {
			pct = 100 * g.v / p.samples
		}
		s = append(s, fmt.Sprintf("%s %.0f%%", g.k, pct))
	}
	return strings.Join(s, ", ")
}

// usage is the CPU the process used over the profiled wall time, in cores.
func (p *cpuProfile) usage() float64 {
	if p.duration == 0 {
		return 0
	}
	return p.samples / p.duration
}

func (p *cpuProfile) render(pr func(string, ...any), title string) {
	pr("%s: %.1f s of CPU over %.1f s profiled (%.2f cores). By group (flat time): %s.", title, p.samples, p.duration, p.usage(), p.groupsLine())
	pr("")
	pr("| function | flat s | cum s | group |")
	pr("| --- | --- | --- | --- |")
	for i, f := range p.top {
		if i == 8 {
			break
		}
		pr("| `%s` | %.2f | %.2f | %s |", f.name, f.flat, f.cum, profGroup(f.name))
	}
	pr("")
}
