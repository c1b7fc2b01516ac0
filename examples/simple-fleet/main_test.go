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

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/memprovider"
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

// rowRE is a row of the fleet's table: name, entry, state, address,
// latency, health.
var rowRE = regexp.MustCompile(`(?m)^(fleet-\d+)\s+(\S+)\s+(\S+)\s+(127\.0\.0\.1:\d+|-)\s+(\S+)\s+(.+)$`)

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
				if r[2] != "memory" || r[3] != "Running" || r[6] != "healthy" {
					t.Errorf("row %q: want entry memory, Running and healthy", r[0])
				}
				if _, err := time.ParseDuration(r[5]); err != nil {
					t.Errorf("row %q: latency %q is not a duration", r[0], r[5])
				}
				addrs[r[4]] = true
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

// -until stops after the stage it names: the table says the proxies were
// not probed, and the fleet is still deleted.
func TestRunUntil(t *testing.T) {
	for _, tt := range []struct {
		until, state string
	}{{"created", "Provisioning"}, {"running", "Running"}} {
		t.Run(tt.until, func(t *testing.T) {
			var out, errb syncBuffer
			if code := run(context.Background(), []string{"-n", "2", "-until", tt.until}, &out, &errb); code != 0 {
				t.Fatalf("exit %d, stderr:\n%s\nstdout:\n%s", code, errb.String(), out.String())
			}
			o := out.String()
			rows := rowRE.FindAllStringSubmatch(o, -1)
			if len(rows) != 2 {
				t.Fatalf("table has %d rows, want 2:\n%s", len(rows), o)
			}
			for _, r := range rows {
				if r[3] != tt.state || r[5] != "-" || r[6] != "not probed (-until "+tt.until+")" {
					t.Errorf("row %q: want %s, not probed", r[0], tt.state)
				}
			}
			if strings.Contains(o, "probed 2 proxies") {
				t.Errorf("-until %s probed:\n%s", tt.until, o)
			}
			if strings.Count(o, "deleted fleet-") != 2 || !strings.Contains(o, "lists 0 instance(s) after cleanup") {
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
		memFaults  func(*egressproxy.Client, *memprovider.Control)
		memGuest   func(*guest.Config)
		code       int
		stderr     []string
		stdout     []string
	}{
		{name: "unknown flag", args: []string{"-bogus"}, code: 2, stderr: []string{"flag provided but not defined: -bogus"}},
		{name: "n zero", args: []string{"-n", "0"}, code: 2, stderr: []string{"-n 0: want 1 to 50"}},
		{name: "positional argument", args: []string{"extra"}, code: 2, stderr: []string{"unexpected arguments"}},
		{name: "missing config", args: []string{"-config", filepath.Join(dir, "nope.yaml")}, code: 1, stderr: []string{"reading -config", "nope.yaml"}},
		{name: "config without entries", args: []string{"-config", write("empty.yaml", "target: example.com:443\n")}, code: 1, stderr: []string{"invalid entries: is required: a list of entries"}},
		{name: "config unknown field", args: []string{"-config", write("typo.yaml", "entries: []\nbogus: 1\n")}, code: 1, stderr: []string{"bogus"}},
		{name: "config bad json", args: []string{"-config", write("bad.json", "{")}, code: 1, stderr: []string{"bad.json"}},
		// Both entries are checked and reported, each with its own
		// reason, before the run fails.
		{name: "config kvm2 entries unusable", args: []string{"-config", write("kvm.yaml", "target: 127.0.0.1:9\nentries:\n"+
			entryYAML("lab1", "127.0.0.1:1", "/nonexistent-key")+entryYAML("lab2", "127.0.0.1:2", "/nonexistent-key"))},
			code:   1,
			stderr: []string{"provider lab1 is not usable: CredentialsUnavailable", "provider lab2 is not usable: CredentialsUnavailable"},
			stdout: []string{"provider lab1 (127.0.0.1:1) NOT reachable after ", "provider lab2 (127.0.0.1:2) NOT reachable after "}},
		{name: "config kvm2 without target", args: []string{"-config", write("kvmnotarget.yaml", "entries:\n"+entryYAML("lab1", "127.0.0.1:1", "/k"))},
			code: 1, stderr: []string{"target: required to probe kvm2 proxies", "-until created"}},
		{name: "until unknown", args: []string{"-until", "ready"}, code: 2, stderr: []string{`-until "ready": want created, running or healthy`}},
		{name: "create refused", memFaults: func(c *egressproxy.Client, p *memprovider.Control) {
			p.InjectFault(memprovider.OpCreate, memprovider.Fault{Code: egressproxy.Permanent, Times: 1})
		}, code: 1, stderr: []string{"create fleet-1", "class Permanent"}},
		{name: "instance fails while starting", memFaults: func(c *egressproxy.Client, p *memprovider.Control) {
			// Every read of the fleet first breaks fleet-2 once it exists
			// (Waiting runs as a delayed call starts, outside the entry's lock).
			p.InjectFault(memprovider.OpGet, memprovider.Fault{Delay: time.Nanosecond, Waiting: func() {
				l, _ := c.List(context.Background())
				for _, inst := range l {
					if inst.Name == "fleet-2" {
						p.SetState(inst.Ref, egressproxy.StateFailed)
					}
				}
			}})
		}, code: 1, stderr: []string{"wait fleet-2: instance is Failed", "class Permanent"}},
		{name: "provider unhealthy", memFaults: func(c *egressproxy.Client, p *memprovider.Control) {
			p.InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Transient, Reason: egressproxy.ReasonUnreachable})
		}, code: 1, stderr: []string{"provider memory is not usable: Unreachable"}},
		{name: "proxy refuses the target", memGuest: func(c *guest.Config) {
			c.AllowedDestinations = nil // port 443 only
		}, code: 1, stderr: []string{"3 of 3 proxies failed the probe"}, stdout: []string{"unhealthy: proxy-status", "status 403"}},
		{name: "never running", args: []string{"-timeout", "1s"}, memOptions: func(o *memprovider.Options) {
			o.ProvisionDelay = time.Hour
		}, code: 1, stderr: []string{"waiting for the fleet"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var out, errb syncBuffer
			code := runWith(context.Background(), tt.args, &out, &errb, memHooks{options: tt.memOptions, provider: tt.memFaults, guest: tt.memGuest})
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
	if !eventually.Poll(ctx, 20*time.Second, func() bool { return strings.Contains(out.String(), "press Ctrl-C") }) {
		cancel()
		<-done
		t.Fatalf("fleet never kept up:\n%s\n%s", out.String(), errb.String())
	}
	// The kept proxies still serve.
	rows := rowRE.FindAllStringSubmatch(out.String(), -1)
	if len(rows) != 2 {
		t.Fatalf("rows: %v", rows)
	}
	for _, r := range rows {
		c, err := net.DialTimeout("tcp", r[4], 5*time.Second)
		if err != nil {
			t.Errorf("kept proxy %s at %s does not accept connections: %v", r[1], r[4], err)
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

// entryYAML is one valid kvm2 entry of a -config file (under "entries:").
func entryYAML(entry, addr, keyFile string) string {
	return "  - entry: " + entry + "\n    owner: fleet\n    address: " + addr + "\n    user: root\n    keyFile: " + keyFile +
		"\n    knownHostsFile: /k/known_hosts\n    pool: default\n    domainType: qemu\n    callTimeout: 30s\n" +
		"    images:\n      tiny: {url: http://127.0.0.1:8099/tiny.qcow2}\n"
}

func TestLoadConfigYAMLAndJSON(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{
		"fleet.yaml": "target: example.com:443\nrunningTimeout: 5m\nprogressInterval: 250ms\nspec:\n  imageKey: tiny\n  port: 8080\nentries:\n" +
			entryYAML("lab1", "10.251.1.2:22022", "/k/id1") + entryYAML("lab2", "10.251.2.2:22022", "/k/id2"),
		"fleet.json": `{"target":"example.com:443","runningTimeout":"5m","progressInterval":"250ms","spec":{"imageKey":"tiny","port":8080},"entries":[` +
			`{"entry":"lab1","owner":"fleet","address":"10.251.1.2:22022","user":"root","keyFile":"/k/id1","knownHostsFile":"/k/known_hosts","pool":"default","domainType":"qemu","callTimeout":"30s","images":{"tiny":{"url":"http://127.0.0.1:8099/tiny.qcow2"}}},` +
			`{"entry":"lab2","owner":"fleet","address":"10.251.2.2:22022","user":"root","keyFile":"/k/id2","knownHostsFile":"/k/known_hosts","pool":"default","domainType":"qemu","callTimeout":"30s","images":{"tiny":{"url":"http://127.0.0.1:8099/tiny.qcow2"}}}]}`,
	} {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(dir, name)
			if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg, err := loadConfig(p)
			if err != nil {
				t.Fatal(err)
			}
			if len(cfg.Entries) != 2 {
				t.Fatalf("%d entries, want 2", len(cfg.Entries))
			}
			for i, want := range []struct{ entry, addr, key string }{{"lab1", "10.251.1.2:22022", "/k/id1"}, {"lab2", "10.251.2.2:22022", "/k/id2"}} {
				e := cfg.Entries[i]
				if e.Entry != want.entry || e.Address != want.addr || e.KeyFile != want.key || e.Owner != "fleet" || e.Pool != "default" ||
					e.DomainType != "qemu" || e.CallTimeout != 30*time.Second || e.Images["tiny"].URL != "http://127.0.0.1:8099/tiny.qcow2" {
					t.Errorf("entries[%d] = %v", i, e)
				}
			}
			if cfg.Spec.ImageKey != "tiny" || cfg.Spec.Port != 8080 || cfg.RunningTimeout != 5*time.Minute || cfg.ProgressInterval != 250*time.Millisecond || cfg.Target != "example.com:443" {
				t.Fatalf("parsed %+v", cfg)
			}
		})
	}
	t.Run("defaults", func(t *testing.T) {
		p := filepath.Join(dir, "min.yaml")
		if err := os.WriteFile(p, []byte("entries:\n"+entryYAML("lab1", "h:22", "/k")), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := loadConfig(p)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.RunningTimeout != defaultRunningTimeout || cfg.ProgressInterval != defaultProgressInterval || cfg.Target != "" {
			t.Errorf("defaults: %+v", cfg)
		}
	})
}

// Every problem of a -config file is reported at once, each naming its
// field (an entry's by its index and name, then kvm2's field or key).
func TestLoadConfigErrors(t *testing.T) {
	dir := t.TempDir()
	ok := entryYAML("lab1", "h:22", "/k")
	tests := []struct {
		name    string
		content string
		want    []string
	}{
		{"no entries", "target: example.com:443\n", []string{"invalid entries: is required: a list of entries"}},
		{"unknown top-level key", "entries:\n" + ok + "bogus: 1\n", []string{"line 13: invalid bogus: unknown key"}},
		{"unknown spec key", "spec: {imagekey2: x}\nentries:\n" + ok, []string{"line 1: invalid spec.imagekey2: unknown key; did you mean imageKey?"}},
		{"go-style spec key", "spec: {ImageKey: tiny}\nentries:\n" + ok, []string{"line 1: invalid spec.ImageKey: unknown key; keys are camelCase: write imageKey"}},
		{"spec name set", "spec: {name: x}\nentries:\n" + ok, []string{"line 1: invalid spec.name: unknown key (keys: imageKey, machineType, port, userData)"}},
		{"syntax", "{", []string{"bad.yaml: kvm2: invalid config: yaml: line 1: "}},
		{"entry missing fields", "entries:\n" + ok + "  - entry: lab2\n    owner: fleet\n", []string{
			"line 13: invalid entries[1].address: is required", "line 13: invalid entries[1].user: is required", "line 13: invalid entries[1].pool: is required",
		}},
		{"entry unknown key", "entries:\n" + ok + "    callTimout: 3s\n", []string{"line 13: invalid entries[0].callTimout: unknown key; did you mean callTimeout?"}},
		{"entry bare-number duration", "entries:\n" + strings.Replace(ok, "callTimeout: 30s", "callTimeout: 30", 1), []string{"line 10: invalid entries[0].callTimeout \"30\"", "bare number"}},
		{"entry bad name", "entries:\n" + strings.Replace(ok, "entry: lab1", "entry: Lab_1", 1), []string{`line 2: invalid entries[0].entry "Lab_1"`}},
		{"duplicate entry", "entries:\n" + ok + ok, []string{`line 13: invalid entries[1].entry "lab1": is also the name of entries[0]`}},
		{"missing image", "spec: {imageKey: debian-12}\nentries:\n" + ok, []string{`invalid entries[0].images: entry lab1 has no image "debian-12" (spec.imageKey)`}},
		{"no images", "entries:\n" + strings.Split(ok, "    images:")[0], []string{"invalid entries[0].images: entry lab1 has no images"}},
		{"spec bad port", "spec: {port: 70000}\nentries:\n" + ok, []string{`invalid spec.port "70000"`}},
		{"bad target", "target: example.com\nentries:\n" + ok, []string{`invalid target "example.com": want the host:port`}},
		{"bad durations", "runningTimeout: 10\nprogressInterval: -1s\nentries:\n" + ok, []string{
			`line 1: invalid runningTimeout "10": must be a duration`, `invalid progressInterval "-1s": want a positive duration`,
		}},
		// Several problems in one file: all of them, in one message.
		{"all at once", "target: nope\nspec: {imageKey: gone, port: -1}\nentries:\n" + ok + "  - entry: lab2\n", []string{
			"6 problems:\n  ", "line 15: invalid entries[1].owner", "line 15: invalid entries[1].pool", `invalid spec.port "-1"`, "invalid target",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			name := "bad.yaml"
			p := filepath.Join(dir, name)
			if err := os.WriteFile(p, []byte(tt.content), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg, err := loadConfig(p)
			if err == nil {
				t.Fatalf("loadConfig = %+v, nil; want an error", cfg)
			}
			msg := err.Error()
			t.Log(msg)
			if !strings.HasPrefix(msg, p+": ") {
				t.Errorf("error %q does not start with the file's path", msg)
			}
			for _, w := range tt.want {
				if !strings.Contains(msg, w) {
					t.Errorf("error lacks %q:\n%s", w, msg)
				}
			}
		})
	}
}
