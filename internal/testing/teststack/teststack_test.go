package teststack

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeTB records Skip/Fatal calls and, like the real thing, stops the calling
// goroutine. Methods it does not override go to the embedded real TB.
type fakeTB struct {
	testing.TB
	mu      sync.Mutex
	skipped string
	fatal   string
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Skipf(format string, args ...any) {
	f.mu.Lock()
	f.skipped = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

func (f *fakeTB) Skip(args ...any) { f.Skipf("%s", fmt.Sprint(args...)) }

func (f *fakeTB) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.fatal = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

func (f *fakeTB) Fatal(args ...any) { f.Fatalf("%s", fmt.Sprint(args...)) }

// call runs fn on its own goroutine (Skip/Fatal end it) and waits.
func (f *fakeTB) call(fn func(testing.TB)) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
}

var allVars = map[string]string{
	VarDir:             "/tmp/egressproxy-stack",
	VarScript:          "/repo/scripts/teststack",
	VarSSHAddr:         "127.0.0.1:22022",
	VarSSHUser:         "root",
	VarUnprivUser:      "egressproxy-unpriv",
	VarSSHKey:          "/tmp/egressproxy-stack/ssh/id_ed25519",
	VarKnownHosts:      "/tmp/egressproxy-stack/ssh/known_hosts",
	VarLibvirtSocket:   "/tmp/egressproxy-stack/libvirt/libvirt-sock",
	VarLibvirtURI:      "qemu:///system",
	VarPool:            "egressproxy-test",
	VarPoolPath:        "/tmp/egressproxy-stack/pool",
	VarSquidAddr:       "127.0.0.1:23128",
	VarSquidAuthAddr:   "127.0.0.1:23129",
	VarSquidUser:       "probe",
	VarSquidPassword:   "secret",
	VarSquidDeniedPort: "9",
}

var allEnv = Env{
	Dir:             "/tmp/egressproxy-stack",
	Script:          "/repo/scripts/teststack",
	SSHAddr:         "127.0.0.1:22022",
	SSHUser:         "root",
	UnprivUser:      "egressproxy-unpriv",
	SSHKey:          "/tmp/egressproxy-stack/ssh/id_ed25519",
	KnownHosts:      "/tmp/egressproxy-stack/ssh/known_hosts",
	LibvirtSocket:   "/tmp/egressproxy-stack/libvirt/libvirt-sock",
	LibvirtURI:      "qemu:///system",
	Pool:            "egressproxy-test",
	PoolPath:        "/tmp/egressproxy-stack/pool",
	SquidAddr:       "127.0.0.1:23128",
	SquidAuthAddr:   "127.0.0.1:23129",
	SquidUser:       "probe",
	SquidPassword:   "secret",
	SquidDeniedPort: 9,
}

func TestRequire(t *testing.T) {
	tests := []struct {
		name      string
		ci        string
		vars      map[string]string // set on top of an all-empty environment
		wantEnv   *Env
		wantSkip  []string // substrings of the skip message; nil: no skip
		wantFatal []string // substrings of the fatal message; nil: no fatal
	}{
		{
			name:     "no stack, not CI: skip naming make test",
			vars:     nil,
			wantSkip: []string{"make test", VarSSHAddr},
		},
		{
			name:     "no stack, CI=false: skip",
			ci:       "false",
			wantSkip: []string{"make test"},
		},
		{
			name:      "no stack, CI=true: fatal naming make test",
			ci:        "true",
			wantFatal: []string{"make test", "CI=true", VarSSHAddr},
		},
		{
			name:      "no SSH addr but other vars, CI=true: still fatal",
			ci:        "true",
			vars:      without(allVars, VarSSHAddr),
			wantFatal: []string{VarSSHAddr},
		},
		{
			name:    "full stack env",
			vars:    allVars,
			wantEnv: &allEnv,
		},
		{
			name:    "full stack env in CI",
			ci:      "true",
			vars:    allVars,
			wantEnv: &allEnv,
		},
		{
			name:      "partial env fails even outside CI, naming what is missing",
			vars:      without(allVars, VarKnownHosts, VarSquidPassword),
			wantFatal: []string{VarKnownHosts, VarSquidPassword},
		},
		{
			name:      "denied port not a number",
			vars:      with(allVars, VarSquidDeniedPort, "nine"),
			wantFatal: []string{VarSquidDeniedPort, "nine"},
		},
		{
			name:      "denied port out of range",
			vars:      with(allVars, VarSquidDeniedPort, "70000"),
			wantFatal: []string{VarSquidDeniedPort},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("CI", tc.ci)
			for k := range allVars {
				t.Setenv(k, "")
			}
			for k, v := range tc.vars {
				t.Setenv(k, v)
			}
			wantCI := tc.ci == "true"
			if got := InCI(); got != wantCI {
				t.Errorf("InCI() = %v, want %v", got, wantCI)
			}

			f := &fakeTB{TB: t}
			var got *Env
			f.call(func(tb testing.TB) {
				env := Require(tb)
				got = &env
			})

			checkMsg(t, "skip", f.skipped, tc.wantSkip)
			checkMsg(t, "fatal", f.fatal, tc.wantFatal)
			switch {
			case tc.wantEnv == nil && got != nil:
				t.Errorf("Require returned %+v, want it to stop the test", *got)
			case tc.wantEnv != nil && got == nil:
				t.Errorf("Require stopped the test, want %+v", *tc.wantEnv)
			case tc.wantEnv != nil:
				if diff := cmp.Diff(*tc.wantEnv, *got); diff != "" {
					t.Errorf("Require() mismatch (-want +got):\n%s", diff)
				}
			}
		})
	}
}

func TestRunWithoutStackSkips(t *testing.T) {
	t.Setenv("CI", "")
	t.Setenv(VarSSHAddr, "")
	f := &fakeTB{TB: t}
	ran := false
	f.call(func(tb testing.TB) {
		Run(tb, "status")
		ran = true
	})
	if ran {
		t.Fatal("Run returned without a stack; want it to skip")
	}
	checkMsg(t, "skip", f.skipped, []string{"make test"})
}

func TestRunFailsOnScriptError(t *testing.T) {
	for k, v := range allVars {
		t.Setenv(k, v)
	}
	// A script that fails with a message on stderr.
	t.Setenv(VarScript, "/bin/false")
	f := &fakeTB{TB: t}
	f.call(func(tb testing.TB) { Run(tb, "sshd-pid") })
	checkMsg(t, "fatal", f.fatal, []string{"/bin/false sshd-pid", "exit status 1"})

	// A script that succeeds: its trimmed stdout is returned.
	t.Setenv(VarScript, "/bin/echo")
	f = &fakeTB{TB: t}
	var out string
	f.call(func(tb testing.TB) { out = Run(tb, "12345") })
	if f.fatal != "" || out != "12345" {
		t.Fatalf("Run(echo 12345) = %q (fatal %q), want %q", out, f.fatal, "12345")
	}
}

func checkMsg(t *testing.T, kind, got string, want []string) {
	t.Helper()
	if want == nil {
		if got != "" {
			t.Errorf("unexpected %s: %s", kind, got)
		}
		return
	}
	if got == "" {
		t.Errorf("no %s, want one mentioning %q", kind, want)
		return
	}
	for _, w := range want {
		if !strings.Contains(got, w) {
			t.Errorf("%s message %q does not mention %q", kind, got, w)
		}
	}
}

func without(m map[string]string, keys ...string) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	for _, k := range keys {
		delete(out, k)
	}
	return out
}

func with(m map[string]string, k, v string) map[string]string {
	out := without(m)
	out[k] = v
	return out
}

func TestNetnsMountIn(t *testing.T) {
	const info = `25 1 0:22 / / rw,relatime - ext4 /dev/vda rw
103 107 0:58 / /var/cache/libvirt rw,relatime - tmpfs egp-netns rw,mode=755
104 107 0:59 / /run/user rw,relatime shared:5 - tmpfs tmpfs rw`
	for _, tt := range []struct {
		dir  string
		want bool
	}{
		{"/var/cache/libvirt/qemu/capabilities", true},
		{"/var/cache/libvirt", true},
		{"/var/cache/libvirtx", false},
		{"/run/user/0", false}, // a tmpfs, but not scripts/netns's
		{"/var/cache", false},
	} {
		if got := netnsMountIn(info, tt.dir); got != tt.want {
			t.Errorf("netnsMountIn(%s) = %v, want %v", tt.dir, got, tt.want)
		}
	}
}
