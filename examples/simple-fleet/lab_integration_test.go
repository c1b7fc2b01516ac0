//go:build integration

package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/testing/lab"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/kvm2"
)

// TestLabFleet runs the fleet the way docs/lab.md documents it: a config
// from `scripts/lab fleet-config` with one kvm2 entry per lab host, `-until
// created` (the lab's guests are out of this namespace's reach, and a tiny
// empty image boots nothing). It checks that every entry's health was
// printed, that each entry's first Create printed its cold fetch, that each
// entry's members exist on its own host and nowhere else, and that a second
// run (warm: no fetch) deletes what it created.
func TestLabFleet(t *testing.T) {
	env := lab.Require(t)
	if len(env.Hosts) < 2 {
		t.Fatalf("the fleet test needs a lab of at least 2 hosts, this one has %d (scripts/lab up --hosts 2)", len(env.Hosts))
	}
	hosts := env.Hosts[:2]
	url, sum := teststack.ServeTinyImage(t)

	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	// Fresh entry names: the bases they fetch are theirs alone, so the
	// first run's fetches are cold even on a lab earlier runs used.
	prefix, owner := "sf"+hex.EncodeToString(b)+"h", "sf-"+hex.EncodeToString(b)
	out, err := exec.Command(env.Script, "fleet-config", "--image-url", url, "--sha256", sum, "--image-key", "tiny",
		"--entry-prefix", prefix, "--owner", owner).Output()
	if err != nil {
		t.Fatalf("scripts/lab fleet-config: %v: %s", err, stderrOf(err))
	}
	path := filepath.Join(t.TempDir(), "fleet.yaml")
	if err := os.WriteFile(path, out, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := loadConfig(path)
	if err != nil {
		t.Fatalf("the config fleet-config printed does not load: %v\n%s", err, out)
	}
	if len(cfg.Entries) != len(env.Hosts) {
		t.Fatalf("fleet-config wrote %d entries for %d hosts", len(cfg.Entries), len(env.Hosts))
	}
	cfg.Entries = cfg.Entries[:2]
	if cfg.Spec.ImageKey != "tiny" {
		t.Fatalf("spec.imageKey %q, want the --image-key given (tiny)", cfg.Spec.ImageKey)
	}
	for i, e := range cfg.Entries {
		h := hosts[i]
		if e.Entry != prefix+strconv.Itoa(h.N) || e.Images["tiny"].SHA256 != sum || e.Address != h.SSHAddr || e.Network != h.Network || e.DomainType != "qemu" || e.Pool != h.Pool {
			t.Fatalf("entries[%d] = %v, want host %d's (%s, network %s, domainType qemu)", i, e, h.N, h.SSHAddr, h.Network)
		}
	}
	// Net under the runs: whatever they leave, deleted through the entries.
	providers := openEntries(t, cfg.Entries)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for i, p := range providers {
			l, _ := p.List(ctx)
			for _, inst := range l {
				if err := p.Delete(ctx, inst.Ref); err != nil {
					t.Errorf("cleanup: delete %s on %s: %v", inst.Name, cfg.Entries[i].Entry, err)
				}
			}
			if err := p.EvictImage(ctx, "tiny"); err != nil {
				t.Errorf("cleanup: evict %s's base: %v", cfg.Entries[i].Entry, err)
			}
		}
	})

	// Run 1: four proxies over two hosts, kept so the hosts can be read.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var o, e syncBuffer
	t0 := time.Now()
	if code := run(ctx, []string{"-config", path, "-n", "4", "-until", "created", "-keep"}, &o, &e); code != 0 {
		t.Fatalf("run 1: exit %d\nstderr:\n%s\nstdout:\n%s", code, e.String(), o.String())
	}
	t.Logf("run 1 (4 proxies, 2 cold fetches) took %v:\n%s", time.Since(t0).Round(time.Millisecond), o.String())
	stdout := o.String()
	want := map[string][]string{ // entry: its members, round-robin
		cfg.Entries[0].Entry: {"fleet-1", "fleet-3"},
		cfg.Entries[1].Entry: {"fleet-2", "fleet-4"},
	}
	for _, c := range cfg.Entries {
		name := regexp.QuoteMeta(c.Entry)
		health := regexp.MustCompile(`(?m)^\[\s*[\d.]+s\] provider ` + name + ` \(` + regexp.QuoteMeta(c.Address) + `\) reachable in \S+ \((.*)\)$`)
		m := health.FindStringSubmatch(stdout)
		if m == nil || !strings.Contains(m[1], "poolState=running") || !strings.Contains(m[1], "domainType=qemu") {
			t.Errorf("no health line for %s at %s with poolState=running and domainType=qemu (got %q)", c.Entry, c.Address, m)
		}
		fetch := regexp.MustCompile(`(?m)^\[\s*[\d.]+s\] ` + name + `: cold fetch of (\S+): .*uploaded.*$`)
		fm := fetch.FindAllStringSubmatch(stdout, -1)
		if len(fm) == 0 {
			t.Errorf("no cold-fetch progress line for %s", c.Entry)
		}
		for _, f := range fm {
			if !strings.Contains(f[1], c.Entry+"--") {
				t.Errorf("%s's progress names volume %s, not one of its own", c.Entry, f[1])
			}
		}
		for _, member := range want[c.Entry] {
			if !regexp.MustCompile(`(?m)^\[\s*[\d.]+s\] created ` + member + ` on ` + name + ` in `).MatchString(stdout) {
				t.Errorf("no line saying %s was created on %s", member, c.Entry)
			}
			if !strings.Contains(stdout, "kept "+member+" (UID ") || !regexp.MustCompile(`(?m)^kept `+member+` \(UID \S+\) on `+name+`, `).MatchString(stdout) {
				t.Errorf("no line saying %s was kept on %s", member, c.Entry)
			}
		}
	}
	// Each entry's members exist on its host (List reads the host the entry
	// dials; it finds the entry's domains only), with the UIDs of this run.
	lctx, lcancel := context.WithTimeout(context.Background(), time.Minute)
	defer lcancel()
	runID := ""
	for i, p := range providers {
		l, err := p.List(lctx)
		if err != nil {
			t.Fatalf("List on %s: %v", cfg.Entries[i].Entry, err)
		}
		var names []string
		for _, inst := range l {
			names = append(names, inst.Name)
			id := strings.TrimPrefix(inst.UID, "simple-fleet-")
			id = id[:strings.LastIndexByte(id, '-')+1]
			if runID == "" {
				runID = id
			} else if id != runID {
				t.Errorf("%s on %s has UID %s, not of this run (%s)", inst.Name, cfg.Entries[i].Entry, inst.UID, runID)
			}
		}
		sort.Strings(names)
		if strings.Join(names, " ") != strings.Join(want[cfg.Entries[i].Entry], " ") {
			t.Errorf("host %d (entry %s) holds %v, want %v", hosts[i].N, cfg.Entries[i].Entry, names, want[cfg.Entries[i].Entry])
		}
		for _, inst := range l {
			if err := p.Delete(lctx, inst.Ref); err != nil {
				t.Errorf("delete kept %s: %v", inst.Name, err)
			}
		}
	}

	// Run 2: warm bases (no fetch), and the program deletes its fleet.
	var o2, e2 syncBuffer
	if code := run(ctx, []string{"-config", path, "-n", "2", "-until", "created"}, &o2, &e2); code != 0 {
		t.Fatalf("run 2: exit %d\nstderr:\n%s\nstdout:\n%s", code, e2.String(), o2.String())
	}
	t.Logf("run 2:\n%s", o2.String())
	stdout = o2.String()
	if strings.Contains(stdout, "cold fetch") {
		t.Errorf("run 2 fetched again, though both hosts hold their entry's base")
	}
	for _, c := range cfg.Entries {
		if !strings.Contains(stdout, "provider "+c.Entry+" lists 0 instance(s) after cleanup") {
			t.Errorf("run 2 did not show %s empty after its cleanup", c.Entry)
		}
	}
	for i, p := range providers {
		if l, err := p.List(lctx); err != nil || len(l) != 0 {
			t.Errorf("after run 2, %s lists %v, %v; want nothing", cfg.Entries[i].Entry, l, err)
		}
	}
}

// openEntries opens one kvm2 provider per entry, closed at cleanup (after
// the cleanup that uses them, which is registered later).
func openEntries(t *testing.T, cfgs []kvm2.Config) []*egressproxy.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out []*egressproxy.Client
	for _, c := range cfgs {
		p, err := kvm2.Open(ctx, c, nil)
		if err != nil {
			t.Fatalf("Open %s: %v", c.Entry, err)
		}
		t.Cleanup(func() {
			if err := p.Close(); err != nil {
				t.Errorf("Close %s: %v", c.Entry, err)
			}
		})
		out = append(out, p)
	}
	return out
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}
