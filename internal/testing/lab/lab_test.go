package lab

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func twoHosts() map[string]string {
	vars := map[string]string{
		VarDir: "/tmp/egressproxy-lab", VarScript: "/repo/scripts/lab", VarHosts: "2",
		VarName: "egp-lab", VarRate: "1gbit", VarRTT: "50ms",
	}
	for _, n := range []string{"1", "2"} {
		for k, v := range map[string]string{
			"NETNS": "egp-lab-" + n, "LINK": "egplab" + n, "ADDR": "10.251." + n + ".2",
			"CALLER_ADDR": "10.251." + n + ".1", "GUEST_NET": "10.252." + n + ".0/24",
			"SSH_ADDR": "10.251." + n + ".2:22022", "DELAY_ADDR": "127.0.0.1:4000" + n, "SSH_USER": "root",
			"SSH_KEY": "/k" + n, "KNOWN_HOSTS": "/kh" + n, "LIBVIRT_SOCKET": "/s" + n, "LIBVIRT_URI": "qemu:///system",
			"POOL": "egressproxy-test", "POOL_PATH": "/p" + n, "NETWORK": "egressproxy-lab", "STACK_DIR": "/d" + n,
		} {
			vars["EGRESSPROXY_LAB_"+n+"_"+k] = v
		}
	}
	return vars
}

func TestFromEnv(t *testing.T) {
	vars := twoHosts()
	env, err := fromEnv(func(k string) string { return vars[k] })
	if err != nil {
		t.Fatal(err)
	}
	if env.RTT != 50*time.Millisecond || len(env.Hosts) != 2 {
		t.Fatalf("RTT %v, %d hosts; want 50ms, 2", env.RTT, len(env.Hosts))
	}
	want := Host{N: 2, Netns: "egp-lab-2", Link: "egplab2", Addr: "10.251.2.2", CallerAddr: "10.251.2.1",
		GuestNet: "10.252.2.0/24", SSHAddr: "10.251.2.2:22022",
		DelayAddr: "127.0.0.1:40002", SSHUser: "root", SSHKey: "/k2", KnownHosts: "/kh2", LibvirtSocket: "/s2",
		LibvirtURI: "qemu:///system", Pool: "egressproxy-test", PoolPath: "/p2", Network: "egressproxy-lab", StackDir: "/d2"}
	if d := cmp.Diff(want, env.Hosts[1]); d != "" {
		t.Errorf("host 2 (-want +got):\n%s", d)
	}
}

func TestFromEnvNamesWhatIsWrong(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change map[string]string
		want   []string
	}{
		{"host var missing", map[string]string{"EGRESSPROXY_LAB_2_SSH_KEY": ""}, []string{"EGRESSPROXY_LAB_2_SSH_KEY"}},
		{"bad count", map[string]string{VarHosts: "zero"}, []string{VarHosts}},
		{"bad rtt", map[string]string{VarRTT: "fast"}, []string{VarRTT}},
		{"more hosts than described", map[string]string{VarHosts: "3"}, []string{"EGRESSPROXY_LAB_3_SSH_ADDR", "EGRESSPROXY_LAB_3_POOL"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vars := twoHosts()
			for k, v := range tc.change {
				vars[k] = v
			}
			_, err := fromEnv(func(k string) string { return vars[k] })
			if err == nil {
				t.Fatal("fromEnv succeeded, want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not name %s", err, w)
				}
			}
		})
	}
}

// fakeTB records Skipf/Fatalf and, like the real thing, stops the calling
// goroutine. Other methods go to the embedded real TB.
type fakeTB struct {
	testing.TB
	mu             sync.Mutex
	skipped, fatal string
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Skipf(format string, args ...any) {
	f.mu.Lock()
	f.skipped = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

func (f *fakeTB) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.fatal = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

func TestRequireSkipsLocallyFailsInCI(t *testing.T) {
	for _, tc := range []struct {
		ci                  string
		wantSkip, wantFatal bool
	}{
		{"", true, false},
		{"false", true, false},
		{"true", false, true},
	} {
		t.Run("CI="+tc.ci, func(t *testing.T) {
			t.Setenv("CI", tc.ci)
			t.Setenv(VarHosts, "")
			f := &fakeTB{TB: t}
			done := make(chan struct{})
			go func() { defer close(done); Require(f) }()
			<-done
			if got := f.skipped != ""; got != tc.wantSkip {
				t.Errorf("skipped %v (%q), want %v", got, f.skipped, tc.wantSkip)
			}
			if got := f.fatal != ""; got != tc.wantFatal {
				t.Errorf("fatal %v (%q), want %v", got, f.fatal, tc.wantFatal)
			}
			if msg := f.skipped + f.fatal; !strings.Contains(msg, VarHosts) || !strings.Contains(msg, "scripts/lab up") {
				t.Errorf("message %q does not name %s and scripts/lab up", msg, VarHosts)
			}
		})
	}
}
