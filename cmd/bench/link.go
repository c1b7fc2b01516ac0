package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// childRun is one run of `bench -fetch-child` under /usr/bin/time -v.
type childRun struct {
	results []benchutil.FetchResult
	rssKiB  float64
}

// runFetchChild runs the fetch child with args (plus -fetch-child, -url,
// -sha256) and returns its results (one, or one per -targets entry) and its
// peak RSS. Every result must have uploaded size bytes.
func runFetchChild(ctx context.Context, url string, img benchutil.Image, args ...string) (childRun, error) {
	self, err := os.Executable()
	if err != nil {
		return childRun{}, err
	}
	a := append([]string{"-v", self, "-fetch-child", "-url", url, "-sha256", img.SHA256}, args...)
	cmd := exec.CommandContext(ctx, "/usr/bin/time", a...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return childRun{}, fmt.Errorf("library cold fetch: %w: %s", err, stderr.String())
	}
	var run childRun
	out := bytes.TrimSpace(stdout.Bytes())
	if bytes.HasPrefix(out, []byte("[")) {
		err = json.Unmarshal(out, &run.results)
	} else {
		var fr benchutil.FetchResult
		err = json.Unmarshal(out, &fr)
		run.results = []benchutil.FetchResult{fr}
	}
	if err != nil {
		return childRun{}, fmt.Errorf("library cold fetch output %q: %w", out, err)
	}
	for _, fr := range run.results {
		if fr.Bytes != img.Size {
			return childRun{}, fmt.Errorf("library uploaded %d bytes, image has %d", fr.Bytes, img.Size)
		}
	}
	m := maxRSS.FindStringSubmatch(stderr.String())
	if m == nil {
		return childRun{}, fmt.Errorf("no maximum RSS in /usr/bin/time output: %s", stderr.String())
	}
	run.rssKiB, _ = strconv.ParseFloat(m[1], 64)
	return run, nil
}

// labHost is one lab host as the benchmarks need it.
type labHost struct {
	n    int
	link string // the caller's end of its veth pair
	env  teststack.Env
	// network is the host's libvirt network for guests.
	network string
}

// parseLabEnv reads the `export K=V` lines of `scripts/lab env` into hosts
// (teststack.Env of each, Dir set to dir for scratch files).
func parseLabEnv(out, dir string) ([]labHost, error) {
	kv := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		l, ok := strings.CutPrefix(strings.TrimSpace(l), "export ")
		if !ok {
			continue
		}
		k, v, _ := strings.Cut(l, "=")
		if uq, err := strconv.Unquote(v); err == nil {
			v = uq
		} else {
			v = strings.Trim(v, "'")
		}
		kv[k] = v
	}
	n, err := strconv.Atoi(kv["EGRESSPROXY_LAB_HOSTS"])
	if err != nil || n < 1 {
		return nil, fmt.Errorf("scripts/lab env: no EGRESSPROXY_LAB_HOSTS in %q", out)
	}
	var hosts []labHost
	for i := 1; i <= n; i++ {
		var missing []string
		g := func(s string) string {
			k := fmt.Sprintf("EGRESSPROXY_LAB_%d_%s", i, s)
			if kv[k] == "" {
				missing = append(missing, k)
			}
			return kv[k]
		}
		h := labHost{n: i, link: g("LINK"), network: g("NETWORK"), env: teststack.Env{
			Dir: dir, SSHAddr: g("SSH_ADDR"), SSHUser: g("SSH_USER"), SSHKey: g("SSH_KEY"), KnownHosts: g("KNOWN_HOSTS"),
			LibvirtSocket: g("LIBVIRT_SOCKET"), LibvirtURI: g("LIBVIRT_URI"), Pool: g("POOL"), PoolPath: g("POOL_PATH"),
		}}
		stack := g("STACK_DIR")
		if len(missing) > 0 {
			return nil, fmt.Errorf("scripts/lab env: unset %s", strings.Join(missing, ", "))
		}
		h.env.Script = stack // unused by the benchmarks; kept for messages
		hosts = append(hosts, h)
	}
	return hosts, nil
}

// linkBytes reads the caller end's counters of a veth: tx is what goes to
// the host (uploads), rx what comes back (read-back).
func linkBytes(link string) (tx, rx int64) {
	rd := func(f string) int64 {
		b, _ := os.ReadFile(filepath.Join("/sys/class/net", link, "statistics", f))
		v, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		return v
	}
	return rd("tx_bytes"), rd("rx_bytes")
}

var rateRE = regexp.MustCompile(`^([0-9]+)(kbit|mbit|gbit)$`)

// rateBits parses a scripts/lab rate (Nkbit, Nmbit, Ngbit) into bits/s.
func rateBits(r string) (float64, error) {
	m := rateRE.FindStringSubmatch(strings.ToLower(r))
	if m == nil {
		return 0, fmt.Errorf("bad rate %q: want e.g. 1gbit, 100mbit", r)
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v * map[string]float64{"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m[2]], nil
}

// labRateSpec is one entry of -lab-rates.
type labRateSpec struct {
	rate     string
	bits     float64
	imageMiB int
}

func parseLabRates(s string) ([]labRateSpec, error) {
	var out []labRateSpec
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		r, m, ok := strings.Cut(f, ":")
		mib, err := strconv.Atoi(m)
		if !ok || err != nil || mib < 1 {
			return nil, fmt.Errorf("-lab-rates %q: want rate:MiB, got %q", s, f)
		}
		bits, err := rateBits(r)
		if err != nil {
			return nil, fmt.Errorf("-lab-rates: %w", err)
		}
		out = append(out, labRateSpec{rate: r, bits: bits, imageMiB: mib})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-lab-rates %q: no rate", s)
	}
	return out, nil
}
