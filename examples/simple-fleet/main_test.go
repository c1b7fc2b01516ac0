package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/egressproxy/egressproxy/provider"
	"github.com/egressproxy/egressproxy/provider/memprovider"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// syncBuffer is a bytes.Buffer safe to read while run writes to it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

var rowRE = regexp.MustCompile(`(?m)^(fleet-\d+)\s+(\S+)\s+(127\.0\.0\.1:\d+)\s+(\S+)\s+(.+)$`)

func TestRunDefaultFleet(t *testing.T) {
	tests := []struct {
		name string
		args []string
		n    int
	}{
		{"no flags", nil, 3},
		{"n=1", []string{"-n", "1"}, 1},
		{"n=5", []string{"-n=5"}, 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb syncBuffer
			code := run(context.Background(), tt.args, &out, &errb)
			if code != 0 {
				t.Fatalf("exit %d, stderr:\n%s\nstdout:\n%s", code, errb.String(), out.String())
			}
			if errb.String() != "" {
				t.Errorf("stderr not empty on success: %q", errb.String())
			}
			o := out.String()
			if !strings.Contains(o, "NAME     STATE    ADDRESS") && !strings.Contains(o, "NAME") {
				t.Errorf("no table header:\n%s", o)
			}
			rows := rowRE.FindAllStringSubmatch(o, -1)
			if len(rows) != tt.n {
				t.Fatalf("table has %d rows, want %d:\n%s", len(rows), tt.n, o)
			}
			addrs := map[string]bool{}
			for _, r := range rows {
				if r[2] != "Running" || r[5] != "healthy" {
					t.Errorf("row %q: want Running and healthy", r[0])
				}
				if _, err := time.ParseDuration(r[4]); err != nil {
					t.Errorf("row %q: latency %q is not a duration", r[0], r[4])
				}
				addrs[r[3]] = true
			}
			if len(addrs) != tt.n {
				t.Errorf("proxies share addresses: %v", addrs)
			}
			if !strings.Contains(o, "Provisioning") {
				t.Errorf("no provisioning progress shown:\n%s", o)
			}
			if !strings.Contains(o, "lists 0 instance(s) after cleanup") || strings.Count(o, "deleted fleet-") != tt.n {
				t.Errorf("fleet not deleted:\n%s", o)
			}
		})
	}
}

func TestRunFailures(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	tests := []struct {
		name       string
		args       []string
		memOptions func(*memprovider.Options)
		memFaults  func(*memprovider.Provider)
		code       int
		stderr     []string
		stdout     []string
	}{
		{name: "unknown flag", args: []string{"-bogus"}, code: 2, stderr: []string{"flag provided but not defined: -bogus"}},
		{name: "n zero", args: []string{"-n", "0"}, code: 2, stderr: []string{"-n 0: want 1 to 50"}},
		{name: "positional argument", args: []string{"extra"}, code: 2, stderr: []string{"unexpected arguments"}},
		{name: "missing config", args: []string{"-config", filepath.Join(dir, "nope.yaml")}, code: 1, stderr: []string{"reading -config", "nope.yaml"}},
		{name: "config without entries", args: []string{"-config", write("empty.yaml", "target: example.com:443\n")}, code: 1, stderr: []string{"no entries"}},
		{name: "config unknown field", args: []string{"-config", write("typo.yaml", "entries: []\nbogus: 1\n")}, code: 1, stderr: []string{"bogus"}},
		{name: "config bad json", args: []string{"-config", write("bad.json", "{")}, code: 1, stderr: []string{"bad.json"}},
		{name: "config without target", args: []string{"-config", write("notarget.yaml", "entries:\n  - entry: lab1\n")}, code: 1, stderr: []string{"target \"\": want the host:port"}},
		{name: "config kvm2 entry", args: []string{"-config", write("kvm.yaml", "target: 127.0.0.1:9\nentries:\n  - entry: lab1\n    owner: fleet\n    address: 127.0.0.1:1\n    user: root\n    keyFile: /nonexistent\n    knownHostsFile: /nonexistent\n    pool: default\n")},
			code: 1, stderr: []string{"simple-fleet: "}},
		{name: "create refused", memFaults: func(p *memprovider.Provider) {
			p.InjectFault(memprovider.OpCreate, memprovider.Fault{Code: provider.Permanent, Times: 1})
		}, code: 1, stderr: []string{"create fleet-1", "class Permanent"}},
		{name: "instance fails while starting", memFaults: func(p *memprovider.Provider) {
			go func() { // once fleet-2 exists, break it
				for i := 0; i < 400; i++ {
					l, err := p.List(context.Background())
					if err != nil {
						return
					}
					for _, inst := range l {
						if inst.Name == "fleet-2" {
							p.SetState(inst.Ref, provider.StateFailed)
							return
						}
					}
					time.Sleep(5 * time.Millisecond)
				}
			}()
		}, code: 1, stderr: []string{"fleet-2 is Failed while starting"}},
		{name: "provider unhealthy", memFaults: func(p *memprovider.Provider) {
			p.InjectFault(memprovider.OpCheck, memprovider.Fault{Code: provider.Transient, Reason: provider.ReasonUnreachable})
		}, code: 1, stderr: []string{"provider memory is not usable: Unreachable"}},
		{name: "proxy refuses the target", memOptions: func(o *memprovider.Options) {
			o.AllowTarget = func(string) bool { return false }
		}, code: 1, stderr: []string{"3 of 3 proxies failed the probe"}, stdout: []string{"unhealthy: proxy-status", "status 403"}},
		{name: "never running", args: []string{"-timeout", "1s"}, memOptions: func(o *memprovider.Options) {
			o.ProvisionDelay = time.Hour
		}, code: 1, stderr: []string{"waiting for the fleet"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			memOptionsHook, memProviderHook = tt.memOptions, tt.memFaults
			defer func() { memOptionsHook, memProviderHook = nil, nil }()
			var out, errb syncBuffer
			code := run(context.Background(), tt.args, &out, &errb)
			if code != tt.code {
				t.Fatalf("exit %d, want %d; stderr:\n%s\nstdout:\n%s", code, tt.code, errb.String(), out.String())
			}
			for _, w := range tt.stderr {
				if !strings.Contains(errb.String(), w) {
					t.Errorf("stderr lacks %q:\n%s", w, errb.String())
				}
			}
			for _, w := range tt.stdout {
				if !strings.Contains(out.String(), w) {
					t.Errorf("stdout lacks %q:\n%s", w, out.String())
				}
			}
			if !strings.HasPrefix(errb.String(), "simple-fleet: ") && !strings.Contains(errb.String(), "flag provided") {
				t.Errorf("message does not start with the program name: %q", errb.String())
			}
		})
	}
}

func TestRunKeepServesUntilInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errb syncBuffer
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"-keep", "-n", "2"}, &out, &errb) }()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(out.String(), "press Ctrl-C") {
		if time.Now().After(deadline) {
			cancel()
			<-done
			t.Fatalf("fleet never kept up:\n%s\n%s", out.String(), errb.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The kept proxies still serve.
	rows := rowRE.FindAllStringSubmatch(out.String(), -1)
	if len(rows) != 2 {
		t.Fatalf("rows: %v", rows)
	}
	for _, r := range rows {
		c, err := net.DialTimeout("tcp", r[3], 5*time.Second)
		if err != nil {
			t.Errorf("kept proxy %s at %s does not accept connections: %v", r[1], r[3], err)
			continue
		}
		c.Close()
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("exit %d after interrupt: %s", code, errb.String())
	}
	if strings.Contains(out.String(), "deleted fleet-") {
		t.Error("-keep deleted the fleet")
	}
}

func TestLoadConfigYAMLAndJSON(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{
		"fleet.yaml": "target: example.com:443\nrunningTimeout: 5m\nspec:\n  imageKey: debian-12\n  port: 8080\nentries:\n  - entry: lab1\n    owner: fleet\n    pool: default\n",
		"fleet.json": `{"target":"example.com:443","runningTimeout":"5m","spec":{"imageKey":"debian-12","port":8080},"entries":[{"entry":"lab1","owner":"fleet","pool":"default"}]}`,
	} {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(dir, name)
			os.WriteFile(p, []byte(content), 0o600)
			cfg, err := loadConfig(p)
			if err != nil {
				t.Fatal(err)
			}
			e := cfg.Entries[0]
			if e.Entry != "lab1" || e.Owner != "fleet" || e.Pool != "default" || cfg.Spec.ImageKey != "debian-12" || cfg.Spec.Port != 8080 || cfg.RunningTimeout != "5m" {
				t.Fatalf("parsed %+v", cfg)
			}
		})
	}
}
