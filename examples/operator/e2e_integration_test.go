//go:build integration

package operator_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/controller"
	"github.com/egressproxy/egressproxy/examples/operator/internal/kustomized"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
	"github.com/egressproxy/egressproxy/internal/testing/lab"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/kvm2"
)

const (
	operatorNS = "egressproxy-system"
	owner      = "ep-operator-e2e"
	// claimTimeout is every entry's image cache claim timeout: the
	// Lease's duration (controller-runtime's default, 15 s), as the
	// README advises, so that the replica taking over from a killed one
	// finds the killed fetch's claim stale (at most claimTimeout after the
	// kill) by the time it holds the Lease. With the default (2m) it waited
	// up to 2 minutes more.
	claimTimeout = 15 * time.Second

	// freezeCallTimeout is the call budget of the entry whose host's
	// sshd the test freezes: every Check of it ends within it, Unreachable
	// when the host did not answer (a caller can wait through several
	// dials of the dead host that other callers started, each up to the
	// dial timeout: only the call budget bounds that).
	freezeCallTimeout = 8 * time.Second
)

// e2eHost is one hypervisor the test's entries run on.
type e2eHost struct {
	addr, user, keyFile, knownHosts string
	socket, uri, pool, poolPath     string
	network                         string
	stackDir                        string // its scripts/teststack dir (sshd's pid file)
}

// e2eHosts returns two hosts: the lab's first two when a lab runs with at
// least two hosts, else the single stack twice (two entries on one host).
func e2eHosts(t *testing.T) []e2eHost {
	t.Helper()
	if os.Getenv(lab.VarHosts) != "" {
		env := lab.Require(t)
		if len(env.Hosts) >= 2 {
			var out []e2eHost
			for _, h := range env.Hosts[:2] {
				out = append(out, e2eHost{h.SSHAddr, h.SSHUser, h.SSHKey, h.KnownHosts, h.LibvirtSocket, h.LibvirtURI, h.Pool, h.PoolPath, h.Network, h.StackDir})
			}
			return out
		}
	}
	env := teststack.Require(t)
	h := e2eHost{env.SSHAddr, env.SSHUser, env.SSHKey, env.KnownHosts, env.LibvirtSocket, env.LibvirtURI, env.Pool, env.PoolPath, "", env.Dir}
	return []e2eHost{h, h}
}

func suffix(t *testing.T) string {
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// entryConfig is the kvm2 Config of entry on h, without credentials (they
// come from a Secret).
func entryConfig(h e2eHost, entry, own string, img imagecache.Image) kvm2.Config {
	return kvm2.Config{
		Entry: entry, Owner: own,
		Address: h.addr, User: h.user,
		LibvirtSocket: h.socket, LibvirtURI: h.uri, Pool: h.pool, Network: h.network,
		Images:       map[string]imagecache.Image{"tiny": img},
		MachineTypes: map[string]kvm2.MachineType{"tiny": {VCPUs: 1, MemoryMiB: 128}},
		DialTimeout:  10 * time.Second,
		ClaimTimeout: claimTimeout,
		DomainType:   "qemu", // KVM hangs in firmware on the test machines (docs/config.md)
	}
}

// sideProvider opens a provider of cfg with file credentials, for the
// test's own look behind the operator's back.
func sideProvider(t *testing.T, h e2eHost, cfg kvm2.Config) *egressproxy.Client {
	t.Helper()
	cfg.KeyFile, cfg.KnownHostsFile = h.keyFile, h.knownHosts
	p, err := kvm2.Open(context.Background(), cfg, &kvm2.Options{Logger: testr.New(t)})
	if err != nil {
		t.Fatalf("open %s: %v", cfg.Entry, err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// startControlPlane starts a kube-apiserver and etcd from assets (each of
// configure changing the environment first) with the module's CRDs installed, stopped at cleanup, and returns them, their
// config and a client that knows the CRDs' types.
func startControlPlane(t *testing.T, assets string, configure ...func(*envtest.Environment)) (*envtest.Environment, *rest.Config, client.Client) {
	t.Helper()
	env := newEnvironment(assets)
	for _, f := range configure {
		f(env)
	}
	env.CRDDirectoryPaths = []string{filepath.Join("config", "crd")}
	env.ErrorIfCRDPathMissing = true
	t0 := time.Now()
	restCfg, err := env.Start()
	if err != nil {
		t.Fatalf("control plane: %v", err)
	}
	t.Cleanup(func() {
		if err := env.Stop(); err != nil {
			t.Errorf("stopping the control plane: %v", err)
		}
	})
	t.Logf("control plane with the CRDs up in %v", time.Since(t0).Round(time.Millisecond))

	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	c, err := client.New(restCfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	return env, restCfg, c
}

// waitFor fails t with cond's last message unless cond returns "" within d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() string) {
	t.Helper()
	eventually.NoError(t, d, func() error {
		if msg := cond(); msg != "" {
			return errors.New(msg)
		}
		return nil
	}, "%s", what)
}

// TestOperatorEndToEnd runs the operator against a real kube-apiserver and
// etcd (envtest, binaries from scripts/kubestack) and real kvm2 entries
// (the lab's two hosts, or the single stack). The operator is the command
// cmd/egressproxy-operator, run as OS processes of its own with the RBAC
// of config/rbac and leader election: the first is killed (SIGKILL) while
// a reconcile is provably in flight, and a second takes over.
func TestOperatorEndToEnd(t *testing.T) {
	assets := controlPlaneAssets(t)
	hosts := e2eHosts(t)
	log := testr.NewWithOptions(t, testr.Options{Verbosity: 0})
	logf.SetLogger(log)

	t0 := time.Now()
	env, restCfg, c := startControlPlane(t, assets)
	ctx := context.Background()
	kubeconfig := operatorKubeconfig(t, ctx, env, c)
	bin := buildOperator(t)

	sfx := suffix(t)
	imgURL, imgSum := teststack.ServeTinyImage(t)
	img := imagecache.Image{URL: imgURL, SHA256: imgSum}
	// The image gamma uses on the second entry: its mirror is held, so
	// that the first operator is killed in the middle of its cold fetch.
	// Its digest differs from tiny's: the operator's providers share the
	// process's fan-out, which copies a verified base of the same digest
	// from another entry's pool instead of asking the mirror.
	held := serveHeldImage(t, teststack.EmptyQCOW2(t, "48M"), "held.qcow2")
	if held.sha256 == imgSum {
		t.Fatalf("the held image has tiny's digest %s: its fetch would be a copy from a peer, not a GET", imgSum)
	}
	entryNames := []string{"ope" + sfx + "a", "ope" + sfx + "b"}

	// The entries' SSH credentials live in Secrets; the entries file
	// names them.
	for _, ns := range []string{operatorNS, "proxies"} {
		if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
			t.Fatal(err)
		}
	}
	ef := controller.EntriesFile{CredentialsSecrets: map[string]string{}}
	side := map[string]*egressproxy.Client{}
	for i, h := range hosts {
		key, err := os.ReadFile(h.keyFile)
		if err != nil {
			t.Fatal(err)
		}
		kh, err := os.ReadFile(h.knownHosts)
		if err != nil {
			t.Fatal(err)
		}
		name := "ssh-" + entryNames[i]
		if err := c.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: name},
			Type:       corev1.SecretTypeSSHAuth,
			Data:       map[string][]byte{controller.SecretKeySSHPrivateKey: key, controller.SecretKeyKnownHosts: kh},
		}); err != nil {
			t.Fatal(err)
		}
		cfg := entryConfig(h, entryNames[i], owner, img)
		if i == 1 {
			cfg.Images["held"] = imagecache.Image{URL: held.url, SHA256: held.sha256}
			cfg.DefaultImage = "tiny"
		}
		ef.Entries = append(ef.Entries, cfg)
		ef.CredentialsSecrets[cfg.Entry] = operatorNS + "/" + name
		side[entryNames[i]] = sideProvider(t, h, cfg)
	}
	// The booting guest: a third entry on the first host, with the
	// project's proxy guest image (direct kernel boot, docs/e2e.md), and
	// the CONNECT target the operator's probes reach through it.
	healthTarget := "127.0.0.1:9" // nothing listens: only the guest is probed
	g := bootingGuest(t)
	var guestEntry string
	if g != nil {
		guestEntry = "ope" + sfx + "c"
		cfg := entryConfig(hosts[0], guestEntry, owner, img)
		cfg.Images = map[string]imagecache.Image{"guest": {URL: guesttest.ServeFile(t, "/guest.qcow2", g.image).URL + "/guest.qcow2", SHA256: g.sha256, Format: "qcow2"}}
		cfg.MachineTypes = map[string]kvm2.MachineType{"small": {VCPUs: 1, MemoryMiB: 512}}
		cfg.Kernel, cfg.Initrd, cfg.Cmdline = g.kernel, g.initrd, g.cmdline
		cfg.ConsoleLogDir = t.TempDir()
		ef.Entries = append(ef.Entries, cfg)
		ef.CredentialsSecrets[cfg.Entry] = operatorNS + "/ssh-" + entryNames[0]
		side[guestEntry] = sideProvider(t, hosts[0], cfg)
		target := guesttest.ServeTarget(t, g.targetIP)
		healthTarget = target.Addr
		g.target = target.Addr
		// The "what is my address" server the operator's probes ask
		// through the guest (--egress-url).
		g.echo = guesttest.ServeEcho(t, g.targetIP)
		t.Cleanup(func() {
			if t.Failed() {
				t.Log(guesttest.ConsoleLog(cfg.ConsoleLogDir, "ep-"+guestEntry+"--"+controller.InstanceName(types.NamespacedName{Namespace: "proxies", Name: "delta"})))
			}
		})
	}
	// The entry whose host (the second) has its sshd frozen at the end: no
	// object uses it; its budgets are short, so that its Checks end within
	// seconds.
	frozenEntry := "ope" + sfx + "d"
	{
		cfg := entryConfig(hosts[1], frozenEntry, owner, img)
		cfg.KeepaliveInterval, cfg.KeepaliveCount = time.Second, 3
		cfg.DialTimeout, cfg.CallTimeout = 3*time.Second, freezeCallTimeout
		ef.Entries = append(ef.Entries, cfg)
		ef.CredentialsSecrets[cfg.Entry] = operatorNS + "/ssh-" + entryNames[1]
	}
	entriesJSON, err := json.Marshal(ef)
	if err != nil {
		t.Fatal(err)
	}
	runDir := t.TempDir()
	entriesFile := filepath.Join(runDir, "entries.yaml")
	if err := os.WriteFile(entriesFile, entriesJSON, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: "proxies", Name: "proxy-creds"},
		Data:       map[string][]byte{"username": []byte("alice"), "password": []byte("s3cret")},
	}); err != nil {
		t.Fatal(err)
	}

	// Each replica runs what config/default's Deployment runs: the
	// image's binary (ociimage.BuildBinary), with the Deployment's flags;
	// those that name the pod's surroundings get this test's values (the
	// entries file, the namespace, the probe target, loopback addresses of
	// its own for the metrics and health endpoints), and the test adds
	// what a pod has no use for: a kubeconfig of operatorUser, short
	// intervals and debug logs (shown when the test fails).
	_, container, err := kustomized.Operator(deployObjects(t))
	if err != nil {
		t.Fatal(err)
	}
	extra := []string{"--kubeconfig=" + kubeconfig,
		"--health-interval=1s", "--gc-interval=2s", "--poll-interval=2s",
		"--backoff-base=200ms", "--backoff-max=5s",
		"--zap-log-level=debug"}
	if g != nil {
		extra = append(extra, "--egress-url="+g.echo.URL)
	}
	argsFor := func(metrics, probes string) []string {
		args, err := kustomized.ProcessArgs(container, map[string]string{
			"entries": entriesFile, "leader-election-namespace": operatorNS, "connect-target": healthTarget,
			"metrics-bind-address": metrics, "health-probe-bind-address": probes,
		}, extra...)
		if err != nil {
			t.Fatal(err)
		}
		return args
	}
	var procs []*operatorProcess
	t.Cleanup(func() {
		if t.Failed() {
			for _, p := range procs {
				t.Logf("the last lines of %s's log:\n%s", p.name, p.tail(150))
			}
		}
	})
	start := func(name string) *operatorProcess {
		metrics, probes := freeLoopbackAddr(t), freeLoopbackAddr(t)
		p := startOperatorProcess(t, bin, name, runDir, argsFor(metrics, probes))
		p.metrics, p.probes = metrics, probes
		procs = append(procs, p)
		return p
	}
	// The hosts of an earlier configuration: the operator's object of an
	// entry no longer configured (to be deleted) and one made by hand (to
	// be left alone).
	staleHost, handHost := "ope"+sfx+"gone", "ope"+sfx+"hand"
	for _, h := range []*v1alpha1.EgressProxyHost{
		{ObjectMeta: metav1.ObjectMeta{Name: staleHost, Labels: map[string]string{controller.ManagedByLabel: controller.ManagedBy}}},
		{ObjectMeta: metav1.ObjectMeta{Name: handHost}},
	} {
		if err := c.Create(ctx, h); err != nil {
			t.Fatal(err)
		}
	}

	op1 := start("operator-1")
	// The Deployment's probes and metrics port: the health endpoints
	// answer, readiness once the caches have synced, and the leader's
	// metrics include its reconciles.
	op1.waitEndpoints(t)

	// The leader's first health rounds: every entry's EgressProxyHost
	// reads Ready with the host's facts, the stale one is gone, and the
	// library's series of every entry are on the metrics port.
	var allEntries []string
	for _, e := range ef.Entries {
		allEntries = append(allEntries, e.Entry)
	}
	waitFor(t, time.Minute, "every entry's host Ready with its facts", func() string {
		for _, e := range allEntries {
			if msg := hostReady(ctx, c, e); msg != "" {
				return msg
			}
		}
		if err := c.Get(ctx, client.ObjectKey{Name: staleHost}, &v1alpha1.EgressProxyHost{}); !apierrors.IsNotFound(err) {
			return fmt.Sprintf("the host of an entry no longer configured: %v, want it deleted", err)
		}
		return ""
	})
	if err := c.Get(ctx, client.ObjectKey{Name: handHost}, &v1alpha1.EgressProxyHost{}); err != nil {
		t.Errorf("the host made by hand: %v, want it left alone", err)
	}
	entryA := map[string]string{"egressproxy_entry": entryNames[0]}
	before0 := scrapeMetrics(t, op1)
	for _, e := range allEntries {
		for _, series := range []string{"egressproxy_entry_reachable", "egressproxy_entry_pool_available_bytes", "egressproxy_entry_memory_available_bytes", "egressproxy_entry_cpu_count"} {
			if v, n := before0.sum(series, map[string]string{"egressproxy_entry": e}); n != 1 || v <= 0 {
				t.Errorf("%s{egressproxy_entry=%s}: %d series, value %v; want one, positive", series, e, n, v)
			}
		}
		if v, n := before0.sum("egressproxy_ssh_connection_state", map[string]string{"egressproxy_entry": e, "egressproxy_ssh_state": "connected"}); n != 1 || v != 1 {
			t.Errorf("egressproxy_ssh_connection_state{egressproxy_entry=%s,connected}: %d series, value %v; want one, 1", e, n, v)
		}
	}
	creates0, _ := before0.sum("egressproxy_client_operation_duration_seconds_count", map[string]string{"egressproxy_entry": entryNames[0], "egressproxy_operation": "create"})
	rpcs0, _ := before0.sum("egressproxy_libvirt_rpc_duration_seconds_count", entryA)
	uploads0, _ := before0.sum("egressproxy_libvirt_rpc_duration_seconds_count", map[string]string{"egressproxy_entry": entryNames[0], "rpc_method": "StorageVolUpload"})

	newEP := func(name, entry string) *v1alpha1.EgressProxy {
		return &v1alpha1.EgressProxy{
			ObjectMeta: metav1.ObjectMeta{Namespace: "proxies", Name: name},
			Spec: v1alpha1.EgressProxySpec{Provider: entry, ProxyTemplate: v1alpha1.ProxyTemplate{Image: "tiny", MachineType: "tiny", Port: 3128,
				CredentialsSecretRef: &v1alpha1.SecretReference{Name: "proxy-creds"}}},
		}
	}
	eps := []*v1alpha1.EgressProxy{newEP("alpha", entryNames[0]), newEP("beta", entryNames[1])}
	var delta *v1alpha1.EgressProxy
	if g != nil {
		// delta boots, so its status gets an address and a real probe
		// result (through the credentials its user-data configures).
		delta = newEP("delta", guestEntry)
		delta.Spec.Image, delta.Spec.MachineType = "guest", "small"
		// Closed by default: the probes' target and the echo server
		// must be allowed destinations.
		delta.Spec.AllowedDestinations = []v1alpha1.Destination{{Ports: []int32{portOf(t, g.target), portOf(t, g.echo.Addr)}}}
	}
	for _, ep := range append(eps, delta) {
		if ep == nil {
			continue
		}
		if err := c.Create(ctx, ep); err != nil {
			t.Fatal(err)
		}
	}

	// vm reads an object's VM on its entry behind the operator's back.
	vm := func(ep *v1alpha1.EgressProxy) (egressproxy.Instance, error) {
		key := types.NamespacedName{Namespace: ep.Namespace, Name: ep.Name}
		return side[ep.Spec.Provider].Get(ctx, egressproxy.Ref{Name: controller.InstanceName(key), UID: string(ep.UID)})
	}
	get := func(ep *v1alpha1.EgressProxy) (*v1alpha1.EgressProxy, error) {
		var got v1alpha1.EgressProxy
		err := c.Get(ctx, client.ObjectKeyFromObject(ep), &got)
		return &got, err
	}
	// converged checks that ep's VM runs its current spec and that status
	// says so honestly.
	converged := func(ep *v1alpha1.EgressProxy, wantPort int) string {
		got, err := get(ep)
		if err != nil {
			return err.Error()
		}
		inst, err := vm(got)
		if err != nil {
			return "VM: " + err.Error()
		}
		if inst.State != egressproxy.StateProvisioning && inst.State != egressproxy.StateRunning {
			return fmt.Sprintf("VM state %s", inst.State)
		}
		if inst.Port != wantPort {
			return fmt.Sprintf("VM port %d, want %d", inst.Port, wantPort)
		}
		st := got.Status
		if st.ObservedGeneration != got.Generation || st.SpecDigest != inst.SpecDigest || st.Provider != got.Spec.Provider {
			return fmt.Sprintf("status generation %d/%d digest %s/%s provider %q", st.ObservedGeneration, got.Generation, st.SpecDigest, inst.SpecDigest, st.Provider)
		}
		if st.Address != inst.Address() {
			return fmt.Sprintf("status address %q, VM %q", st.Address, inst.Address())
		}
		pr := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionProviderReachable)
		if pr == nil || pr.Status != metav1.ConditionTrue {
			return fmt.Sprintf("ProviderReachable %+v", pr)
		}
		hc := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionHealthy)
		if st.Address == "" {
			// The tiny image does not boot: no address, so nothing to
			// probe; status must say exactly that.
			if st.Phase != v1alpha1.PhaseProvisioning || st.Health != v1alpha1.HealthUnknown || hc == nil || hc.Reason != controller.ReasonNoAddress {
				return fmt.Sprintf("no address but phase %q health %q Healthy %+v", st.Phase, st.Health, hc)
			}
		} else if st.Phase != v1alpha1.PhaseRunning || hc == nil {
			return fmt.Sprintf("address %s but phase %q Healthy %+v", st.Address, st.Phase, hc)
		}
		return ""
	}
	for _, ep := range eps {
		waitFor(t, 4*time.Minute, "VM of "+ep.Name, func() string {
			if err := c.Get(ctx, client.ObjectKeyFromObject(ep), ep); err != nil {
				return err.Error()
			}
			return converged(ep, 3128)
		})
	}
	t.Logf("both VMs defined and started, status converged, after %v", time.Since(t0).Round(time.Second))

	// The series moved: alpha's cold Create (its entry's first, the tiny
	// image fetched from the mirror and uploaded to the pool) is one more
	// create, made of libvirt calls, the upload among them; its host
	// counts the running VM.
	after := scrapeMetrics(t, op1)
	if v, _ := after.sum("egressproxy_client_operation_duration_seconds_count", map[string]string{"egressproxy_entry": entryNames[0], "egressproxy_operation": "create"}); v <= creates0 {
		t.Errorf("creates on %s: %v before alpha's, %v after", entryNames[0], creates0, v)
	}
	if v, _ := after.sum("egressproxy_libvirt_rpc_duration_seconds_count", entryA); v <= rpcs0 {
		t.Errorf("libvirt calls of %s: %v before alpha's Create, %v after", entryNames[0], rpcs0, v)
	}
	if v, _ := after.sum("egressproxy_libvirt_rpc_duration_seconds_count", map[string]string{"egressproxy_entry": entryNames[0], "rpc_method": "StorageVolUpload"}); v <= uploads0 {
		t.Errorf("StorageVolUpload calls of %s: %v before alpha's cold Create, %v after", entryNames[0], uploads0, v)
	}
	// The image cache's series: alpha's and beta's cold Creates are the
	// process's first fetches of the tiny image, so no peer holds it and
	// its bytes come from the mirror (one download the two entries share:
	// which entry counts them is the cache's business, their sum is not);
	// alpha's entry then has a base.
	var mirror0, mirror float64
	for _, e := range entryNames {
		bytesOf := map[string]string{"egressproxy_entry": e, "egressproxy_image_source": "mirror"}
		v0, _ := before0.sum("egressproxy_image_transfer_size_bytes_total", bytesOf)
		v, _ := after.sum("egressproxy_image_transfer_size_bytes_total", bytesOf)
		mirror0, mirror = mirror0+v0, mirror+v
	}
	if mirror <= mirror0 {
		t.Errorf("egressproxy_image_transfer_size_bytes_total{egressproxy_image_source=mirror} of %v: %v before the cold Creates, %v after; want more\n%s", entryNames, mirror0, mirror, after.lines("egressproxy_image_"))
	}
	if v, n := after.sum("egressproxy_image_base_count", entryA); n == 0 || v < 1 {
		t.Errorf("egressproxy_image_base_count{egressproxy_entry=%s} after alpha's cold Create: %d series, %v; want at least 1", entryNames[0], n, v)
	}
	t.Logf("operator-1's /metrics after the first Creates (the library's series of %s):\n%s", entryNames[0],
		after.lines("egressproxy_entry_")+"\n"+after.lines("egressproxy_image_base_")+"\n"+after.lines("egressproxy_image_transfer_")+"\n"+
			after.lines(`egressproxy_client_operation_duration_seconds_count{egressproxy_entry="`+entryNames[0]+`",egressproxy_operation="create"`))
	waitFor(t, 30*time.Second, "alpha's VM counted on its host", func() string {
		_, rows := hostTable(t, restCfg)
		if r := rows[entryNames[0]]; r["Proxies"] != "1" || r["Ready"] != "True" || r["Reason"] != controller.ReasonReachable || r["Free"] == "<none>" {
			return fmt.Sprintf("host %s's row: %v", entryNames[0], r)
		}
		return ""
	})
	table, _ := hostTable(t, restCfg)
	t.Logf("kubectl get egressproxyhosts:\n%s", table)
	if delta != nil {
		healthyGuest(t, ctx, c, side[guestEntry], delta, g, converged)
		t.Logf("delta's guest booted and its status says Running and Healthy after %v", time.Since(t0).Round(time.Second))
		healthySeries(t, op1, controller.InstanceName(client.ObjectKeyFromObject(delta)))
		egressObserved(t, ctx, c, delta, g)
	}
	before, err := vm(eps[0])
	if err != nil {
		t.Fatal(err)
	}

	// Drift: a new port recreates alpha's VM.
	alpha, err := get(eps[0])
	if err != nil {
		t.Fatal(err)
	}
	alpha.Spec.Port = 8080
	if err := c.Update(ctx, alpha); err != nil {
		t.Fatal(err)
	}
	waitFor(t, time.Minute, "the recreate to start", func() string {
		if inst, err := vm(alpha); err == nil && inst.SpecDigest == before.SpecDigest {
			return "old VM still there"
		}
		return ""
	})

	// The kill. gamma is a new object on the second entry whose image is
	// not in that host's pool yet: its Create fetches it from the held
	// mirror. The operator is killed once that reconcile is provably in
	// flight: the object has the finalizer, the mirror has sent half the
	// image, the fetch's claim volume is in the host's pool, no VM exists
	// and status has not converged.
	gamma := newEP("gamma", entryNames[1])
	gamma.Spec.Image = "held"
	if err := c.Create(ctx, gamma); err != nil {
		t.Fatal(err)
	}
	held.waitGET(t, 2*time.Minute, "the first operator's cold fetch of gamma's image")
	heldBase := basecache.BaseName(entryNames[1], "held", imagecache.FormatQCOW2)
	claimPrefix := "claim-" + strings.TrimPrefix(heldBase, "base-") + "."
	waitFor(t, time.Minute, "gamma's reconcile in flight", func() string {
		got, err := get(gamma)
		if err != nil || !controllerutil.ContainsFinalizer(got, controller.Finalizer) {
			return fmt.Sprintf("no finalizer yet (%v)", err)
		}
		if got.Status.SpecDigest != "" {
			return "status already says " + got.Status.SpecDigest
		}
		if cl := poolVolumes(t, hosts[1].poolPath, claimPrefix); len(cl) == 0 {
			return "no claim volume " + claimPrefix + "* in the pool"
		}
		if _, err := vm(got); egressproxy.Code(err) != egressproxy.NotFound {
			return fmt.Sprintf("gamma's VM: %v (want NotFound)", err)
		}
		return ""
	})
	holder1, leaseDur, transitions1, err := leaseHolder(ctx, c)
	if err != nil || holder1 == "" {
		t.Fatalf("the Lease before the kill: holder %q, %v", holder1, err)
	}
	atKill := poolVolumes(t, hosts[1].poolPath, "")
	op1.kill(t)
	killedAt := time.Now()
	// What the killed fetch left (listed after the kill: until then its
	// heartbeat replaced its claim volume every claimTimeout/4).
	killedClaims := poolVolumes(t, hosts[1].poolPath, claimPrefix)
	if len(killedClaims) == 0 {
		t.Fatalf("no claim volume %s* in the pool after the kill: %v", claimPrefix, poolVolumes(t, hosts[1].poolPath, ""))
	}
	t.Logf("operator-1 (Lease holder %s) killed mid-reconcile after %v; host 2's pool then: %s", holder1, time.Since(t0).Round(time.Second), strings.Join(atKill, " "))
	if h, _, _, err := leaseHolder(ctx, c); err != nil || h != holder1 {
		t.Fatalf("after the kill the Lease says holder %q (%v); want the killed %s (a killed leader releases nothing)", h, err, holder1)
	}

	// While no operator runs: an owned VM without an object (to be
	// collected) and a VM of another owner on the same entry (never to be
	// touched) are created behind its back.
	orphan := egressproxy.Spec{Name: "orphan-" + sfx, UID: "no-such-object-" + sfx, ImageKey: "tiny", MachineType: "tiny"}
	if _, err := side[entryNames[0]].Create(ctx, orphan); err != nil {
		t.Fatalf("create the orphan: %v", err)
	}
	foreignCfg := entryConfig(hosts[0], entryNames[0], "someone-else", img)
	foreign := sideProvider(t, hosts[0], foreignCfg)
	fspec := egressproxy.Spec{Name: "foreign-" + sfx, UID: "foreign-" + sfx, ImageKey: "tiny", MachineType: "tiny"}
	if _, err := foreign.Create(ctx, fspec); err != nil {
		t.Fatalf("create the foreign VM: %v", err)
	}
	t.Cleanup(func() { _ = foreign.Delete(context.Background(), egressproxy.Ref{Name: fspec.Name, UID: fspec.UID}) })

	// The new replica: it gets the Lease only once the killed holder's
	// has run out.
	op2 := start("operator-2")
	op2.waitEndpoints(t)
	var holder2 string
	waitFor(t, 2*time.Minute, "operator-2 to acquire the Lease", func() string {
		h, _, tr, err := leaseHolder(ctx, c)
		if err != nil {
			return err.Error()
		}
		if h == holder1 || h == "" {
			return "holder " + h
		}
		if tr <= transitions1 {
			return fmt.Sprintf("new holder %s but leaseTransitions %d (was %d)", h, tr, transitions1)
		}
		holder2 = h
		return ""
	})
	took := time.Since(killedAt)
	t.Logf("operator-2 (%s) acquired the Lease %v after the kill (lease duration %v)", holder2, took.Round(100*time.Millisecond), leaseDur)
	if took < leaseDur {
		t.Errorf("the Lease changed hands %v after the kill, before its duration %v ran out", took, leaseDur)
	}

	// operator-2's Create of gamma finds the killed fetch's claim; it
	// takes the image over once that claim is stale (the entries' claim
	// timeout after its last refresh, so by now or within seconds), and
	// its own fetch is held too, until the end of the next step. The
	// takeover is operator-2's: its log says it removed each claim volume
	// the killed fetch left, and they are gone from the pool. It comes well
	// before the default claim timeout (2m, refreshed every 30 s) could
	// have let it: that would be at least 90 s after the kill.
	held.waitGET(t, 4*time.Minute, "operator-2's fetch of gamma's image, after the killed fetch's claim went stale")
	refetch := time.Since(killedAt)
	t.Logf("operator-2 fetches gamma's image %v after the kill (claim timeout %v, lease %v)", refetch.Round(time.Second), claimTimeout, leaseDur)
	if limit := 90 * time.Second; refetch >= limit {
		t.Errorf("operator-2's fetch of gamma's image came %v after the kill, not before %v: the entries' claim timeout (%v) did not apply", refetch.Round(time.Second), limit, claimTimeout)
	}
	now := poolVolumes(t, hosts[1].poolPath, claimPrefix)
	for _, cl := range killedClaims {
		if slices.Contains(now, cl) {
			t.Errorf("the killed fetch's claim %s is still in the pool while operator-2 fetches (pool: %v)", cl, now)
		}
		removed := false
		for _, line := range op2.grep(cl) {
			// imagecache's "removing stale volume" (V(1)) or, once
			// under its own claim, "removing debris".
			removed = removed || strings.Contains(line, "removing stale volume") || strings.Contains(line, "removing debris")
		}
		if !removed {
			t.Errorf("operator-2's log does not say it removed the killed fetch's stale claim %s", cl)
		}
	}

	// While gamma's reconcile waits on its image, other objects are
	// reconciled: beta (on the same entry) is updated and converges.
	beta, err := get(eps[1])
	if err != nil {
		t.Fatal(err)
	}
	beta.Spec.Port = 8081
	if err := c.Update(ctx, beta); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 90*time.Second, "beta converged on port 8081 while gamma's fetch is held", func() string { return converged(beta, 8081) })
	if _, err := vm(gamma); egressproxy.Code(err) != egressproxy.NotFound {
		t.Fatalf("gamma's VM while its image is still held: %v (want NotFound)", err)
	}
	held.unblock()

	waitFor(t, 4*time.Minute, "gamma converged after the restart", func() string { return converged(gamma, 3128) })
	waitFor(t, 4*time.Minute, "alpha converged on port 8080 after the restart", func() string { return converged(alpha, 8080) })
	eps = append(eps, gamma)
	if delta != nil {
		// The new replica probes the booted guest again.
		healthyGuest(t, ctx, c, side[guestEntry], delta, g, converged)
		healthySeries(t, op2, controller.InstanceName(client.ObjectKeyFromObject(delta)))
		eps = append(eps, delta)
	}
	if inst, _ := vm(alpha); inst.SpecDigest == before.SpecDigest {
		t.Errorf("alpha's VM still has the old spec digest")
	}
	t.Logf("every object converged after the restart, %v after the kill", time.Since(killedAt).Round(time.Second))

	// GC: the owned orphan is collected, the foreign VM is not.
	waitFor(t, time.Minute, "the orphan collected", func() string {
		if _, err := side[entryNames[0]].Get(ctx, egressproxy.Ref{Name: orphan.Name, UID: orphan.UID}); egressproxy.Code(err) != egressproxy.NotFound {
			return fmt.Sprintf("orphan Get: %v", err)
		}
		return ""
	})
	time.Sleep(5 * time.Second) // two more GC rounds, which must leave the foreign VM alone
	if _, err := foreign.Get(ctx, egressproxy.Ref{Name: fspec.Name, UID: fspec.UID}); err != nil {
		t.Errorf("the foreign VM after GC: %v (want it untouched)", err)
	}
	// Exactly one VM per object, each on its object's entry: the kill
	// and the takeover made no second one.
	want := map[string][]string{}
	for _, ep := range eps {
		got, err := get(ep)
		if err != nil {
			t.Fatal(err)
		}
		want[ep.Spec.Provider] = append(want[ep.Spec.Provider], controller.InstanceName(client.ObjectKeyFromObject(ep))+"/"+string(got.UID))
	}
	for entry, p := range side {
		l, err := p.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var have []string
		for _, inst := range l {
			have = append(have, inst.Name+"/"+inst.UID)
		}
		sort.Strings(have)
		sort.Strings(want[entry])
		if strings.Join(have, " ") != strings.Join(want[entry], " ") {
			t.Errorf("entry %s lists %v, want exactly %v", entry, have, want[entry])
		}
	}

	// Delete every object: the finalizer deletes the VMs and their
	// volumes, then the objects go.
	for _, ep := range eps {
		if err := c.Delete(ctx, ep); err != nil {
			t.Fatal(err)
		}
	}
	for _, ep := range eps {
		waitFor(t, 2*time.Minute, "deletion of "+ep.Name, func() string {
			if _, err := get(ep); !apierrors.IsNotFound(err) {
				return fmt.Sprintf("object: %v", err)
			}
			if _, err := vm(ep); egressproxy.Code(err) != egressproxy.NotFound {
				return fmt.Sprintf("VM: %v", err)
			}
			return ""
		})
	}
	type entryOn struct {
		entry string
		h     e2eHost
	}
	var all []entryOn
	for i, h := range hosts {
		all = append(all, entryOn{entryNames[i], h})
	}
	if guestEntry != "" {
		all = append(all, entryOn{guestEntry, hosts[0]})
	}
	for _, e := range all {
		h := e.h
		l, err := side[e.entry].List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(l) != 0 {
			t.Errorf("entry %s still lists %d instances: %+v", e.entry, len(l), l)
		}
		for _, f := range poolVolumes(t, h.poolPath, "") {
			for _, ep := range eps {
				if strings.Contains(f, e.entry+"--"+controller.InstanceName(client.ObjectKeyFromObject(ep))) {
					t.Errorf("volume %s of %s left in pool %s", f, ep.Name, h.pool)
				}
			}
		}
		// No image cache debris either: the killed fetch's claim and
		// partial base were taken over, and every claim was released.
		if cl := poolVolumes(t, h.poolPath, "claim-"+e.entry+"--"); len(cl) != 0 {
			t.Errorf("claim volumes left in pool %s: %v", h.pool, cl)
		}
	}
	if vols := poolVolumes(t, hosts[1].poolPath, heldBase); len(vols) != 2 || vols[0] != heldBase || vols[1] != basecache.MarkerName(heldBase, held.sha256) {
		t.Errorf("gamma's image in pool %s: %v, want exactly the base %s and its marker", hosts[1].pool, vols, heldBase)
	}
	// The deleted objects' proxies have no health series any more (a
	// probe in flight when one was deleted is forgotten with its round).
	waitFor(t, 30*time.Second, "the deleted proxies' health series gone", func() string {
		m := scrapeMetrics(t, op2)
		for _, ep := range eps {
			id := controller.InstanceName(client.ObjectKeyFromObject(ep))
			if _, n := m.sum("egressproxy_health_proxy_state", map[string]string{"egressproxy_proxy_id": id}); n != 0 {
				return fmt.Sprintf("%s's object is deleted but it has %d egressproxy_health_proxy_state series", id, n)
			}
		}
		return ""
	})

	// The second host's sshd frozen: the host of the entry kept for it
	// turns not Ready, reason Unreachable, within one of its Check rounds
	// (the interval, then a Check that ends within the entry's call
	// budget; probes of proxies whose objects were just deleted, which
	// time out, do not hold the entry's Checks up), and its
	// reachable series says 0; the first host's entries stay Ready.
	// Thawed, it is Ready again.
	thaw := freezeSSHD(t, hosts[1].stackDir)
	frozenAt := time.Now()
	roundBound := time.Second /* --health-interval */ + freezeCallTimeout + 5*time.Second
	waitFor(t, roundBound, "host "+frozenEntry+" Unreachable after its sshd froze", func() string {
		var h v1alpha1.EgressProxyHost
		if err := c.Get(ctx, client.ObjectKey{Name: frozenEntry}, &h); err != nil {
			return err.Error()
		}
		cond := meta.FindStatusCondition(h.Status.Conditions, v1alpha1.ConditionHostReady)
		if cond == nil || cond.Status != metav1.ConditionFalse || cond.Reason != string(egressproxy.ReasonUnreachable) || h.Status.Capacity != nil {
			return fmt.Sprintf("Ready %+v, capacity %+v", cond, h.Status.Capacity)
		}
		return ""
	})
	t.Logf("host %s read Unreachable %v after its sshd froze", frozenEntry, time.Since(frozenAt).Round(100*time.Millisecond))
	if hosts[1].stackDir != hosts[0].stackDir {
		if msg := hostReady(ctx, c, entryNames[0]); msg != "" {
			t.Errorf("while host 2's sshd is frozen: %s", msg)
		}
	}
	if v, n := scrapeMetrics(t, op2).sum("egressproxy_entry_reachable", map[string]string{"egressproxy_entry": frozenEntry}); n != 1 || v != 0 {
		t.Errorf("egressproxy_entry_reachable{egressproxy_entry=%s} while frozen: %d series, %v; want 0", frozenEntry, n, v)
	}
	frozenTable, _ := hostTable(t, restCfg)
	thaw()
	thawedAt := time.Now()
	waitFor(t, roundBound, "host "+frozenEntry+" Ready again after its sshd thawed", func() string { return hostReady(ctx, c, frozenEntry) })
	t.Logf("host %s Ready again %v after the thaw; while frozen:\n%s", frozenEntry, time.Since(thawedAt).Round(100*time.Millisecond), frozenTable)

	// A graceful stop: exit status 0 and the Lease released at once.
	if err := op2.terminate(time.Minute); err != nil {
		t.Errorf("operator-2 on SIGTERM: %v", err)
	}
	if h, _, _, err := leaseHolder(ctx, c); err != nil || h != "" {
		t.Errorf("after operator-2's graceful stop the Lease says holder %q (%v); want it released", h, err)
	}
	// Every line both processes wrote is JSON with an RFC 3339 time, from
	// the start through leader election and reconciles to the shutdown
	// (operator-2's; operator-1 was killed). client-go's leader election
	// logs through the logger controller-runtime puts in its context;
	// whatever client-go logs through klog's global logger is routed to
	// the same JSON logger (TestDeploymentLogsJSON).
	stages1 := map[string]string{
		"start":           ": Starting EventSource",
		"leader election": ": Attempting to acquire leader lease",
	}
	stages2 := maps.Clone(stages1)
	stages2["leader elected"] = ": Successfully acquired lease"
	stages2["reconcile"] = ": created"
	stages2["shutdown"] = ": Stopping and waiting for leader election runnables"
	checkJSONLogs(t, procs, map[*operatorProcess]map[string]string{op1: stages1, op2: stages2})
	// The operator ran with exactly the README's RBAC.
	for _, p := range procs {
		if lines := p.grep("is forbidden: User"); len(lines) > 0 {
			t.Errorf("%s was refused by the apiserver (the ClusterRole of config/rbac lacks a permission the code needs):\n%s", p.name, strings.Join(lines, "\n"))
		}
	}
	t.Logf("end to end in %v", time.Since(t0).Round(time.Second))
}

// guestImage is the project's proxy guest (scripts/guestimage env) and
// where, on the first lab host, the guest reaches the test.
type guestImage struct {
	image, sha256, kernel, initrd, cmdline string
	targetIP                               string // the caller's end of lab host 1's link
	target                                 string // the probes' CONNECT target on targetIP
	echo                                   *guesttest.Echo
}

// bootingGuest returns the guest to boot on the first lab host, or nil
// (logged) when the guest image or the lab is absent outside CI; under
// CI=true both must be there.
func bootingGuest(t *testing.T) *guestImage {
	t.Helper()
	g := &guestImage{
		image: os.Getenv("EGRESSPROXY_GUEST_IMAGE"), sha256: os.Getenv("EGRESSPROXY_GUEST_IMAGE_SHA256"),
		kernel: os.Getenv("EGRESSPROXY_GUEST_KERNEL"), initrd: os.Getenv("EGRESSPROXY_GUEST_INITRD"), cmdline: os.Getenv("EGRESSPROXY_GUEST_CMDLINE"),
	}
	missing := g.image == "" || g.sha256 == "" || g.kernel == "" || g.initrd == "" || g.cmdline == ""
	noLab := os.Getenv(lab.VarHosts) == ""
	if missing || noLab {
		why := "no guest image (eval \"$(scripts/guestimage env)\")"
		if !missing {
			why = "no lab (the guest needs a lab host's routed network; docs/lab.md)"
		}
		if lab.InCI() {
			t.Fatalf("CI=true: %s: the booting guest's status and health cannot be shown", why)
		}
		t.Logf("%s: no booting guest; status address and health are shown only for the non-booting image", why)
		return nil
	}
	g.targetIP = lab.Require(t).Hosts[0].CallerAddr
	return g
}

// healthyGuest waits until ep's guest has booted and the operator's status
// says so: an address in the lab's guest network, phase Running and the
// Healthy condition True from a real CONNECT probe through Squid with the
// proxy credentials. A probe of the test's own without credentials is
// refused with 407, so the credentials the user-data configures are the
// ones Squid requires.
func healthyGuest(t *testing.T, ctx context.Context, c client.Client, side *egressproxy.Client, ep *v1alpha1.EgressProxy, g *guestImage, converged func(*v1alpha1.EgressProxy, int) string) {
	t.Helper()
	var got v1alpha1.EgressProxy
	// First the VM itself, behind the operator's back: the operator
	// creates it (after fetching the guest image), and it runs with an
	// address (a VM that never boots fails here, not as a status that
	// never converges).
	if err := c.Get(ctx, client.ObjectKeyFromObject(ep), &got); err != nil {
		t.Fatal(err)
	}
	ref := egressproxy.Ref{Name: controller.InstanceName(client.ObjectKeyFromObject(ep)), UID: string(got.UID)}
	eventually.NoError(t, 8*time.Minute, func() error {
		if _, err := side.Get(ctx, ref); egressproxy.Code(err) == egressproxy.NotFound {
			return err
		}
		return nil
	}, "delta's VM created")
	wctx, cancel := context.WithTimeout(ctx, 8*time.Minute)
	inst, err := side.WaitRunning(wctx, ref, &egressproxy.WaitOptions{Interval: 2 * time.Second})
	cancel()
	if err != nil {
		t.Fatalf("delta's guest: %v", err)
	}
	t.Logf("delta's guest runs at %s", inst.Address())
	waitFor(t, 8*time.Minute, "delta's guest Running and Healthy", func() string {
		if err := c.Get(ctx, client.ObjectKeyFromObject(ep), &got); err != nil {
			return err.Error()
		}
		if msg := converged(&got, 3128); msg != "" {
			return msg
		}
		hc := meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionHealthy)
		if got.Status.Address == "" || got.Status.Phase != v1alpha1.PhaseRunning || got.Status.Health != v1alpha1.HealthHealthy ||
			hc == nil || hc.Status != metav1.ConditionTrue || hc.Reason != controller.ReasonHealthy {
			return fmt.Sprintf("address %q phase %q health %q Healthy %+v", got.Status.Address, got.Status.Phase, got.Status.Health, hc)
		}
		return ""
	})
	res := health.Probe(ctx, got.Status.Address, g.target, &health.ProbeOptions{Timeout: 15 * time.Second})
	if res.OK || res.Kind != health.KindAuthRequired {
		t.Fatalf("a probe of %s without credentials: ok %v kind %v status %d err %v; want AuthRequired (407)", got.Status.Address, res.OK, res.Kind, res.StatusCode, res.Err)
	}
}

// healthySeries checks that p's metrics say proxy id is healthy: its
// series of the state gauge, and no other state of it.
func healthySeries(t *testing.T, p *operatorProcess, id string) {
	t.Helper()
	m := scrapeMetrics(t, p)
	if v, n := m.sum("egressproxy_health_proxy_state", map[string]string{"egressproxy_proxy_id": id, "egressproxy_health_state": "healthy"}); n != 1 || v != 1 {
		t.Errorf("%s's egressproxy_health_proxy_state{egressproxy_proxy_id=%s,healthy}: %d series, %v; want one, 1\n%s", p.name, id, n, v, m.lines("egressproxy_health_"))
	}
	if _, n := m.sum("egressproxy_health_proxy_state", map[string]string{"egressproxy_proxy_id": id}); n != 1 {
		t.Errorf("%s has %d state series of %s, want one", p.name, n, id)
	}
	if v, _ := m.sum("egressproxy_health_probe_duration_seconds_count", map[string]string{"egressproxy_probe_kind": "none"}); v < 1 {
		t.Errorf("%s counts %v successful probes", p.name, v)
	}
	t.Logf("%s's /metrics: %s", p.name, m.lines(`egressproxy_health_proxy_state{`))
}

func portOf(t *testing.T, hostport string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(hostport)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return int32(n)
}

// egressObserved: ep's status.egressAddress is the address the echo
// server saw its probes come from; when the echo server reports another,
// status follows and the object gets exactly one EgressAddressChanged
// event, also after more probes.
func egressObserved(t *testing.T, ctx context.Context, c client.Client, ep *v1alpha1.EgressProxy, g *guestImage) {
	t.Helper()
	var got v1alpha1.EgressProxy
	egress := func() string {
		if err := c.Get(ctx, client.ObjectKeyFromObject(ep), &got); err != nil {
			return err.Error()
		}
		return got.Status.EgressAddress
	}
	waitFor(t, time.Minute, ep.Name+"'s egress address in status", func() string {
		seen := g.echo.Seen()
		if e := egress(); len(seen) == 0 || e != seen[len(seen)-1] {
			return fmt.Sprintf("status.egressAddress %q, the echo server saw %v", e, seen)
		}
		return ""
	})
	t.Logf("%s's status.egressAddress %s is what the echo server saw", ep.Name, got.Status.EgressAddress)
	changed := func() ([]eventsv1.Event, error) {
		var list eventsv1.EventList
		if err := c.List(ctx, &list, client.InNamespace(ep.Namespace)); err != nil {
			return nil, err
		}
		var out []eventsv1.Event
		for _, e := range list.Items {
			if e.Reason == controller.ReasonEgressAddressChanged && e.Regarding.Name == ep.Name {
				out = append(out, e)
			}
		}
		return out, nil
	}
	if evs, err := changed(); err != nil || len(evs) != 0 {
		t.Fatalf("EgressAddressChanged events before any change: %d (err %v), want none", len(evs), err)
	}
	const moved = "192.0.2.77"
	g.echo.Report(moved)
	waitFor(t, time.Minute, ep.Name+"'s new egress address in status", func() string {
		if e := egress(); e != moved {
			return fmt.Sprintf("status.egressAddress %q, want %s", e, moved)
		}
		return ""
	})
	// More probes after the change (the health interval is 1s): still
	// one event.
	n := len(g.echo.Seen())
	waitFor(t, time.Minute, "three more egress probes", func() string {
		if m := len(g.echo.Seen()); m < n+3 {
			return fmt.Sprintf("%d more", m-n)
		}
		return ""
	})
	var evs []eventsv1.Event
	waitFor(t, 30*time.Second, "the event", func() string {
		var err error
		if evs, err = changed(); err != nil {
			return err.Error()
		}
		if len(evs) == 0 {
			return "none yet"
		}
		return ""
	})
	if len(evs) != 1 || (evs[0].Series != nil && evs[0].Series.Count > 1) || !strings.Contains(evs[0].Note, moved) {
		t.Fatalf("EgressAddressChanged events after one change: %+v; want exactly one naming %s", evs, moved)
	}
	t.Logf("one EgressAddressChanged event: %q", evs[0].Note)
}
