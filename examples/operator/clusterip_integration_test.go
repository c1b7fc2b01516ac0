//go:build integration

package operator_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
)

// The ClusterIP test's addresses, documentation ranges only: the
// Services' ClusterIPs come from serviceRange, routed in the test's
// network namespace so that a connect() to one leaves the socket for
// kube-proxy's DNAT; the memory entries' proxies listen on proxyNodeIP,
// added to the namespace's lo (an IPv4 EndpointSlice refuses loopback).
const (
	serviceRange = "198.51.100.0/24"
	proxyNodeIP  = "192.0.2.1"
	kubeNodeName = "egp-kube-proxy"
)

// requireNetnsRoot skips the test unless it runs as root in the network
// namespace of scripts/netns (it changes the namespace's addresses,
// routes and packet filter); under CI=true it fails instead.
func requireNetnsRoot(t *testing.T) {
	t.Helper()
	name, _, ok, err := guesttest.Netns()
	if err != nil {
		t.Fatal(err)
	}
	var why string
	switch {
	case !ok:
		why = "not in the test network namespace (EGRESSPROXY_NETNS unset; run it under scripts/netns run)"
	case os.Geteuid() != 0:
		why = "not root in the network namespace " + name
	}
	if why == "" {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal(why)
	}
	t.Skip(why)
}

// kubeProxyBinary is $EGRESSPROXY_KUBE_PROXY, else what `scripts/kubestack
// env` names; without one the test skips, or fails under CI=true.
func kubeProxyBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("EGRESSPROXY_KUBE_PROXY")
	if bin == "" {
		out, err := exec.Command("bash", "-c", `lines=$("$0" env) && eval "$lines" && printf %s "$EGRESSPROXY_KUBE_PROXY"`, kubestack).Output()
		if err == nil && len(out) > 0 {
			bin = string(out)
		}
	}
	if bin != "" {
		if _, err := os.Stat(bin); err == nil {
			return bin
		}
	}
	msg := "no kube-proxy built (EGRESSPROXY_KUBE_PROXY): run scripts/kubestack build, then eval \"$(scripts/kubestack env)\""
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// run runs a command (ip, iptables) and fails t with its output if it
// fails.
func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
}

// routeServiceRange adds proxyNodeIP to lo and a route for serviceRange
// (from proxyNodeIP) in this network namespace, removed when the test
// ends.
func routeServiceRange(t *testing.T) {
	t.Helper()
	run(t, "ip", "addr", "add", proxyNodeIP+"/32", "dev", "lo")
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "addr", "del", proxyNodeIP+"/32", "dev", "lo").CombinedOutput(); err != nil {
			t.Errorf("ip addr del: %v: %s", err, out)
		}
	})
	run(t, "ip", "route", "add", serviceRange, "dev", "lo", "src", proxyNodeIP)
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "route", "del", serviceRange, "dev", "lo").CombinedOutput(); err != nil {
			t.Errorf("ip route del: %v: %s", err, out)
		}
	})
}

// startKubeProxy creates this namespace's Node (its InternalIP
// proxyNodeIP) and runs kube-proxy (iptables mode) for it as the user
// system:kube-proxy (the apiserver's bootstrap RBAC binds it to
// system:node-proxier). kube-proxy leaves the global conntrack sysctls
// alone. When the test ends it is stopped (TERM) and its rules removed
// (kube-proxy --cleanup).
// The returned function says why kube-proxy is not running ("" while it
// is).
func startKubeProxy(t *testing.T, pe *poolEnv, bin string) func() string {
	t.Helper()
	ctx := context.Background()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: kubeNodeName}}
	if err := pe.c.Create(ctx, node); err != nil {
		t.Fatal(err)
	}
	node.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: proxyNodeIP}}
	if err := pe.c.Status().Update(ctx, node); err != nil {
		t.Fatal(err)
	}
	u, err := pe.env.AddUser(envtest.User{Name: "system:kube-proxy"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := u.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, kc, 0o600); err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(dir, "kube-proxy.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	cmd := exec.Command(bin,
		"--kubeconfig", kubeconfig,
		"--hostname-override", kubeNodeName,
		"--proxy-mode", "iptables",
		"--bind-address", proxyNodeIP,
		"--healthz-bind-address", freeLoopbackAddr(t),
		"--metrics-bind-address", freeLoopbackAddr(t),
		"--iptables-localhost-nodeports=false",
		"--conntrack-max-per-core", "0",
		"--conntrack-tcp-timeout-established", "0",
		"--conntrack-tcp-timeout-close-wait", "0",
		"--v", "2",
	)
	cmd.Env = append(os.Environ(), "PATH="+os.Getenv("PATH")+":/usr/local/sbin:/usr/sbin:/sbin")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatalf("start kube-proxy: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	var exitErr error
	ended := false
	t.Cleanup(func() {
		if !ended {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(10 * time.Second):
				_ = cmd.Process.Kill()
				<-exited
			}
		}
		if out, err := exec.Command(bin, "--cleanup", "--proxy-mode", "iptables").CombinedOutput(); err != nil {
			t.Errorf("kube-proxy --cleanup: %v: %s", err, out)
		}
		removeKubeRules(t)
		if t.Failed() {
			if b, err := os.ReadFile(logPath); err == nil {
				t.Logf("kube-proxy's log (tail):\n%s", tail(string(b), 40))
			}
		}
	})
	// Called from the test's goroutine only.
	return func() string {
		if !ended {
			select {
			case exitErr = <-exited:
				ended = true
			default:
				return ""
			}
		}
		return fmt.Sprintf("kube-proxy exited: %v (its log: %s)", exitErr, logPath)
	}
}

// dnatRule is a line of `iptables-save -c -t nat` for an endpoint of
// kube-proxy's: its packet count and destination.
var dnatRule = regexp.MustCompile(`^\[(\d+):\d+\] -A KUBE-SEP-\S+ .*-j DNAT --to-destination (\S+)$`)

// dnatCounts is how many connections kube-proxy's rules of this network
// namespace have sent to each endpoint it programs now.
func dnatCounts(t *testing.T) map[string]int {
	t.Helper()
	out, err := exec.Command("iptables-save", "-c", "-t", "nat").Output()
	if err != nil {
		t.Fatalf("iptables-save: %v", err)
	}
	n := map[string]int{}
	for _, line := range strings.Split(string(out), "\n") {
		if m := dnatRule.FindStringSubmatch(line); m != nil {
			c, _ := strconv.Atoi(m[1])
			n[m[2]] += c
		}
	}
	return n
}

// removeKubeRules removes what kube-proxy --cleanup leaves in this
// network namespace, the empty chain KUBE-FIREWALL (shared with the
// kubelet) and its jumps from INPUT and OUTPUT, of both families, and
// fails t if a KUBE- chain or rule is left.
func removeKubeRules(t *testing.T) {
	t.Helper()
	for _, family := range []string{"iptables", "ip6tables"} {
		if exec.Command(family, "-t", "filter", "-S", "KUBE-FIREWALL").Run() == nil {
			for _, from := range []string{"INPUT", "OUTPUT"} {
				for exec.Command(family, "-t", "filter", "-D", from, "-j", "KUBE-FIREWALL").Run() == nil {
				}
			}
			run(t, family, "-t", "filter", "-F", "KUBE-FIREWALL")
			run(t, family, "-t", "filter", "-X", "KUBE-FIREWALL")
		}
		out, err := exec.Command(family + "-save").Output()
		if err != nil {
			t.Errorf("%s-save: %v", family, err)
			continue
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, "KUBE-") {
				t.Errorf("%s: kube-proxy's %q left after its cleanup", family, line)
			}
		}
	}
}

// tail is s's last n lines.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// clusterIPClient sends CONNECTs, about every 40 ms, each on a connection
// of its own to svc (the Service's ClusterIP and port: kube-proxy picks
// the endpoint), until the returned function is called; that returns how
// many were sent and which failed.
func clusterIPClient(svc, target string) func() (int, []string) {
	done := make(chan struct{})
	type result struct {
		sent   int
		failed []string
	}
	out := make(chan result, 1)
	go func() {
		var res result
		tick := time.NewTicker(40 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				out <- res
				return
			case <-tick.C:
			}
			res.sent++
			if r := health.Probe(context.Background(), svc, target, &health.ProbeOptions{Username: "pool-user", Password: "pool-password", Timeout: 2 * time.Second}); !r.OK {
				res.failed = append(res.failed, fmt.Sprintf("%s at %s: %v", svc, time.Now().Format("15:04:05.000"), r.Err))
			}
		}
	}()
	return func() (int, []string) { close(done); r := <-out; return r.sent, r.failed }
}

// TestPoolRollsOutThroughClusterIP is TestPoolRollsOutOnMemoryEntries with
// the client of a cluster: kube-proxy (built by scripts/kubestack from the
// control plane's module) runs in the test's network namespace and
// programs the pool's Service; the client sends its CONNECTs to the
// Service's ClusterIP and kube-proxy balances them over the endpoints of
// the pool's EndpointSlices (IPv4: the memory entries' proxies listen on
// a documentation address). No CONNECT fails during the rollout, the
// client sends at least 20/s, and the slices never list fewer than 6
// ready.
func TestPoolRollsOutThroughClusterIP(t *testing.T) {
	requireNetnsRoot(t)
	bin := kubeProxyBinary(t)
	routeServiceRange(t)
	pe := startPoolEnvWith(t, poolEnvOptions{
		proxyAddress: netip.MustParseAddr(proxyNodeIP),
		controlPlane: func(env *envtest.Environment) {
			env.ControlPlane.GetAPIServer().Configure().Set("service-cluster-ip-range", serviceRange)
		},
	})
	proxyDown := startKubeProxy(t, pe, bin)
	rollOut(t, pe, "roll", func(key client.ObjectKey) func() (int, []string) {
		var svc corev1.Service
		if err := pe.c.Get(context.Background(), key, &svc); err != nil {
			t.Fatalf("the pool's Service: %v", err)
		}
		prefix := netip.MustParsePrefix(serviceRange)
		ip, err := netip.ParseAddr(svc.Spec.ClusterIP)
		if err != nil || !prefix.Contains(ip) || len(svc.Spec.Ports) != 1 {
			t.Fatalf("Service %s: ClusterIP %q, ports %+v; want one in %s and one port", key, svc.Spec.ClusterIP, svc.Spec.Ports, serviceRange)
		}
		addr := net.JoinHostPort(ip.String(), fmt.Sprint(svc.Spec.Ports[0].Port))
		// kube-proxy has programmed the Service once a CONNECT to it
		// succeeds: nothing listens on the ClusterIP itself.
		t0 := time.Now()
		waitFor(t, time.Minute, "a CONNECT through the ClusterIP "+addr, func() string {
			if why := proxyDown(); why != "" {
				t.Fatal(why)
			}
			r := health.Probe(context.Background(), addr, pe.target, &health.ProbeOptions{Username: "pool-user", Password: "pool-password", Timeout: time.Second})
			if !r.OK {
				return fmt.Sprint(r.Err)
			}
			return ""
		})
		t.Logf("the ClusterIP %s forwards, %v after the pool was Healthy", addr, time.Since(t0).Round(time.Millisecond))
		stop := clusterIPClient(addr, pe.target)
		return func() (int, []string) {
			sent, failed := stop()
			// kube-proxy's DNAT rule per endpoint counts the
			// connections it sent there (the nat table sees a
			// connection's first packet only).
			n := dnatCounts(t)
			t.Logf("connections kube-proxy sent to the endpoints it programs now: %v", n)
			if len(n) != 6 {
				t.Errorf("kube-proxy programs %d endpoints, want the pool's 6", len(n))
			}
			for ep, c := range n {
				if c == 0 {
					t.Errorf("kube-proxy sent no connection to %s", ep)
				}
			}
			return sent, failed
		}
	})
}
