package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/controller"
	"github.com/egressproxy/egressproxy/examples/operator/internal/memhost"
	"github.com/egressproxy/egressproxy/memprovider"
)

const (
	operatorNS   = "egressproxy-system"
	proxiesNS    = "scale"
	operatorUser = "egressproxy-operator"
)

// controlPlaneAssets is the directory holding kube-apiserver and etcd:
// $KUBEBUILDER_ASSETS, else what `scripts/kubestack env` names.
func controlPlaneAssets(kubestack string) (string, error) {
	dir := os.Getenv("KUBEBUILDER_ASSETS")
	if dir == "" {
		var stderr strings.Builder
		cmd := exec.Command("bash", "-c", `lines=$("$0" env) && eval "$lines" && printf %s "$KUBEBUILDER_ASSETS"`, kubestack)
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil || len(out) == 0 {
			return "", fmt.Errorf("no Kubernetes control plane built (%s env: %v: %s): run scripts/kubestack build", kubestack, err, strings.TrimSpace(stderr.String()))
		}
		dir = string(out)
	}
	for _, bin := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(dir, bin)); err != nil {
			return "", fmt.Errorf("KUBEBUILDER_ASSETS=%s lacks %s: %w", dir, bin, err)
		}
	}
	return dir, nil
}

// runResult is one run's figures (stored as JSON in the report).
type runResult struct {
	N, M        int
	CallDelayMS float64
	Start       time.Time
	Load        string // load average at the run's start
	LoadEnd     string

	ConvergeS, RunningS float64 // from the process's start: all Healthy; all Running

	RestS          float64
	CPUCores       float64
	RSSMiB         float64 // the largest sample in the window
	Goroutines     float64 // the largest sample in the window
	APIPerS        map[string]float64
	APIPerSTotal   float64
	StandbyAPIPerS float64 // the second replica's requests per second (all verbs)
	CallsPerSEntry float64 // library calls per second, mean over entries
	CallsPerSMax   float64 // … of the busiest entry
	CallsByOp      map[string]float64
	Workers        float64 // the leader's controller_runtime_max_concurrent_reconciles
	RoundS         float64 // mean wall time of a health round in the window
	RoundProxies   float64
	Rounds         int
	ProbesPerS     float64

	Failover         bool
	LeaseDurationS   float64
	LeaseTakenS      float64 // from the kill
	LeaseExpiryS     float64 // from the kill: the old holder's renewTime + duration
	FreshS           float64 // from the kill
	FreshAfterExpiry float64

	// MemoryHost: the entries were served by a memory host (internal/memhost)
	// whose VMs outlive the operator; false in runs from before it, whose
	// VMs died with the leader and whose FreshS waited for them anew.
	MemoryHost bool
	// From the kill: the new leader had reconciled N objects
	// (controller_runtime_reconcile_total), and its tracker had decided
	// every proxy healthy (egressproxy_operator_health_proxies).
	ReconciledS, DecidedS float64
	// The new leader's status writes (PATCH requests) and library Creates
	// from the Lease until every status was fresh.
	FailoverPatches, FailoverCreates float64
}

// process is one operator replica.
type process struct {
	name            string
	cmd             *exec.Cmd
	metrics, probes string
	log             string
	exited          chan struct{}
	err             error
	started         time.Time
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func startProcess(bin, name, logDir string, args []string) (*process, error) {
	m, err := freeAddr()
	if err != nil {
		return nil, err
	}
	pr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	p := &process{name: name, metrics: m, probes: pr, log: filepath.Join(logDir, name+".log"), exited: make(chan struct{})}
	f, err := os.Create(p.log)
	if err != nil {
		return nil, err
	}
	p.cmd = exec.Command(bin, append(args, "--metrics-bind-address="+m, "--health-probe-bind-address="+pr)...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	p.started = time.Now()
	if err := p.cmd.Start(); err != nil {
		f.Close()
		return nil, err
	}
	go func() {
		p.err = p.cmd.Wait()
		f.Close()
		close(p.exited)
	}()
	return p, nil
}

func (p *process) alive() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// stop ends p: SIGTERM, then SIGKILL after a minute.
func (p *process) stop() {
	if !p.alive() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(time.Minute):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

func (p *process) kill() error {
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	select {
	case <-p.exited:
		return nil
	case <-time.After(30 * time.Second):
		return fmt.Errorf("%s did not end within 30s of SIGKILL", p.name)
	}
}

// ready waits until p answers /readyz.
func (p *process) ready(ctx context.Context, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		resp, err := http.Get("http://" + p.probes + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if !p.alive() {
			return fmt.Errorf("%s exited (%v) before it was ready", p.name, p.err)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready within %v", p.name, d)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// serveTarget is the CONNECT target of the probes: it accepts and closes
// (a probe needs only the proxy's 2xx).
func serveTarget() (net.Listener, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return ln, nil
}

func runOne(ctx context.Context, o *options, assets, bin, logDir string, rs runSpec) (*runResult, error) {
	res := &runResult{N: rs.N, M: rs.M, CallDelayMS: float64(o.callDelay) / float64(time.Millisecond), Start: time.Now().UTC(), Load: loadAvg()}
	logf0("N=%d M=%d: starting the control plane (load %s)", rs.N, rs.M, res.Load)
	env := &envtest.Environment{
		BinaryAssetsDirectory:    assets,
		CRDDirectoryPaths:        []string{filepath.Join(o.moduleDir, "config", "crd")},
		ErrorIfCRDPathMissing:    true,
		ControlPlaneStartTimeout: 3 * time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
	}
	// As the operator's integration tests do (controlplane_test.go): a
	// loopback advertise address, and no endpoint reconciler.
	env.ControlPlane.GetAPIServer().Configure().Set("advertise-address", "127.0.0.1")
	env.ControlPlane.GetAPIServer().Configure().Set("endpoint-reconciler-type", "none")
	restCfg, err := env.Start()
	if err != nil {
		return nil, fmt.Errorf("control plane: %w", err)
	}
	defer func() {
		if err := env.Stop(); err != nil {
			logf0("stopping the control plane: %v", err)
		}
	}()
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	restCfg.QPS, restCfg.Burst = 200, 400 // the bench's own client: not what is measured
	c, err := client.New(restCfg, client.Options{Scheme: scheme})
	if err != nil {
		return nil, err
	}
	for _, ns := range []string{operatorNS, proxiesNS} {
		if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
			return nil, err
		}
	}
	kubeconfig, err := operatorKubeconfig(ctx, o, env, c, logDir)
	if err != nil {
		return nil, err
	}
	target, err := serveTarget()
	if err != nil {
		return nil, err
	}
	defer target.Close()
	targetPort := target.Addr().(*net.TCPAddr).Port

	host, entries, entriesFile, err := startMemoryHost(o, rs, logDir)
	if err != nil {
		return nil, err
	}
	defer closeHost(host)
	res.MemoryHost = host != nil

	// N objects, round-robin over the entries, open to the target's port.
	t0 := time.Now()
	if err := createObjects(ctx, c, rs.N, entries, int32(targetPort)); err != nil {
		return nil, err
	}
	logf0("N=%d M=%d: created %d objects in %v", rs.N, rs.M, rs.N, time.Since(t0).Round(time.Millisecond))

	args := []string{"--kubeconfig=" + kubeconfig, "--entries=" + entriesFile, "--leader-election-namespace=" + operatorNS,
		"--connect-target=" + target.Addr().String(), "--health-interval=" + o.healthInterval.String()}
	if o.workers > 0 {
		args = append(args, "--max-concurrent-reconciles="+strconv.Itoa(o.workers))
	}
	name := func(i int) string { return fmt.Sprintf("operator-%d-%d-%d", rs.N, rs.M, i) }
	leader, err := startProcess(bin, name(1), logDir, args)
	if err != nil {
		return nil, err
	}
	defer leader.stop()

	// Converge: every object Running and Healthy in status.
	var runningAt time.Time
	err = poll(ctx, o.timeout, time.Second, func() (bool, error) {
		if !leader.alive() {
			return false, fmt.Errorf("%s exited: %v", leader.name, leader.err)
		}
		running, healthy, err := countStatus(ctx, c, time.Time{})
		if err != nil {
			return false, nil // the apiserver is busy: try again
		}
		if running == rs.N && runningAt.IsZero() {
			runningAt = time.Now()
		}
		return healthy == rs.N, nil
	})
	if err != nil {
		return nil, fmt.Errorf("convergence: %w", err)
	}
	res.ConvergeS = time.Since(leader.started).Seconds()
	res.RunningS = runningAt.Sub(leader.started).Seconds()
	logf0("N=%d M=%d: every object Running after %.1fs, Healthy after %.1fs", rs.N, rs.M, res.RunningS, res.ConvergeS)

	var standby *process
	if o.failover {
		if standby, err = startProcess(bin, name(2), logDir, args); err != nil {
			return nil, err
		}
		defer standby.stop()
		if err := standby.ready(ctx, 3*time.Minute); err != nil {
			return nil, err
		}
	}
	if err := sleep(ctx, o.settle); err != nil {
		return nil, err
	}
	if err := measureRest(ctx, o, res, leader, standby); err != nil {
		return nil, fmt.Errorf("at rest: %w", err)
	}
	logf0("N=%d M=%d: at rest %.3f cores, %.0f MiB, %.0f goroutines, %.2f apiserver requests/s, %.1f calls/s per entry, health round %.2fs",
		rs.N, rs.M, res.CPUCores, res.RSSMiB, res.Goroutines, res.APIPerSTotal, res.CallsPerSEntry, res.RoundS)
	if o.failover {
		if err := failover(ctx, o, res, c, leader, standby); err != nil {
			return nil, fmt.Errorf("failover: %w", err)
		}
		logf0("N=%d M=%d: failover: Lease taken %.1fs after the kill, every status fresh after %.1fs", rs.N, rs.M, res.LeaseTakenS, res.FreshS)
	}
	res.LoadEnd = loadAvg()
	return res, nil
}

// closeHost closes the memory host, if any.
func closeHost(host *memhost.Server) {
	if host == nil {
		return
	}
	if err := host.Close(); err != nil {
		logf0("closing the memory host: %v", err)
	}
}

// startMemoryHost serves M memory entries from this process, whose VMs
// outlive the operators, and writes the entries file that names them with
// the host's endpoint, so both replicas see the same VMs. With
// -in-process it starts no host (nil) and the file has the entries in
// the operator's process.
func startMemoryHost(o *options, rs runSpec, logDir string) (*memhost.Server, []string, string, error) {
	entries := make([]string, rs.M)
	hostEntries := make([]memprovider.Options, rs.M)
	for i := range entries {
		entries[i] = fmt.Sprintf("mem-%03d", i)
		hostEntries[i] = memprovider.Options{Entry: entries[i], CallDelay: o.callDelay, ServeProxies: true}
	}
	var host *memhost.Server
	if !o.inProcess {
		var err error
		if host, err = memhost.Serve("127.0.0.1:0", hostEntries); err != nil {
			return nil, nil, "", fmt.Errorf("memory host: %w", err)
		}
	}
	var sb strings.Builder
	sb.WriteString(controller.MemoryEntriesKey + ":\n")
	for _, e := range entries {
		if host != nil {
			fmt.Fprintf(&sb, "- {entry: %s, endpoint: %q}\n", e, host.URL())
		} else {
			fmt.Fprintf(&sb, "- {entry: %s, callDelay: %s}\n", e, o.callDelay)
		}
	}
	entriesFile := filepath.Join(logDir, fmt.Sprintf("entries-%d-%d.yaml", rs.N, rs.M))
	if err := os.WriteFile(entriesFile, []byte(sb.String()), 0o644); err != nil {
		if host != nil {
			_ = host.Close()
		}
		return nil, nil, "", err
	}
	return host, entries, entriesFile, nil
}

func createObjects(ctx context.Context, c client.Client, n int, entries []string, port int32) error {
	work := make(chan int)
	errc := make(chan error, 1)
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for i := range work {
				ep := &v1alpha1.EgressProxy{
					ObjectMeta: metav1.ObjectMeta{Namespace: proxiesNS, Name: fmt.Sprintf("p-%05d", i)},
					Spec: v1alpha1.EgressProxySpec{Provider: entries[i%len(entries)], ProxyTemplate: v1alpha1.ProxyTemplate{Open: true,
						AllowedDestinations: []v1alpha1.Destination{{Ports: []int32{port}}}}},
				}
				if err := c.Create(ctx, ep); err != nil {
					select {
					case errc <- fmt.Errorf("create %s: %w", ep.Name, err):
					default:
					}
				}
			}
		})
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	select {
	case err := <-errc:
		return err
	default:
		return nil
	}
}

// countStatus counts the objects whose status is Running, and those that
// are also Healthy with a Healthy condition that changed after since
// (zero: any time).
func countStatus(ctx context.Context, c client.Client, since time.Time) (running, healthy int, err error) {
	var list v1alpha1.EgressProxyList
	if err := c.List(ctx, &list, client.InNamespace(proxiesNS)); err != nil {
		return 0, 0, err
	}
	for _, ep := range list.Items {
		if ep.Status.Phase != v1alpha1.PhaseRunning {
			continue
		}
		running++
		if ep.Status.Health != v1alpha1.HealthHealthy {
			continue
		}
		cond := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionHealthy)
		if cond == nil || cond.Status != metav1.ConditionTrue {
			continue
		}
		if !since.IsZero() && !cond.LastTransitionTime.Time.After(since) {
			continue
		}
		healthy++
	}
	return running, healthy, nil
}

// measureRest samples the leader over the at-rest window.
func measureRest(ctx context.Context, o *options, res *runResult, leader, standby *process) error {
	pid := leader.cmd.Process.Pid
	m0, err := scrape(ctx, leader.metrics)
	if err != nil {
		return err
	}
	var s0 []sample
	if standby != nil {
		if s0, err = scrape(ctx, standby.metrics); err != nil {
			return err
		}
	}
	p0, err := readProc(pid)
	if err != nil {
		return err
	}
	end := p0.At.Add(o.rest)
	var rssMax int64
	var gorMax float64
	for {
		st, err := readProc(pid)
		if err != nil {
			return err
		}
		rssMax = max(rssMax, st.RSS)
		if m, err := scrape(ctx, leader.metrics); err == nil {
			gorMax = max(gorMax, value(m, "go_goroutines"))
		}
		if !time.Now().Before(end) {
			break
		}
		if err := sleep(ctx, min(5*time.Second, time.Until(end))); err != nil {
			return err
		}
	}
	p1, err := readProc(pid)
	if err != nil {
		return err
	}
	m1, err := scrape(ctx, leader.metrics)
	if err != nil {
		return err
	}
	wall := p1.At.Sub(p0.At).Seconds()
	res.RestS = wall
	res.CPUCores = (p1.CPU - p0.CPU).Seconds() / wall
	res.RSSMiB = float64(max(rssMax, p1.RSS)) / (1 << 20)
	res.Goroutines = max(gorMax, value(m1, "go_goroutines"))
	for _, x := range m1 {
		if x.Name == "controller_runtime_max_concurrent_reconciles" && x.Labels["controller"] == "egressproxy" {
			res.Workers = x.Value
		}
	}
	res.APIPerS = map[string]float64{}
	b0, b1 := sumBy(m0, "rest_client_requests_total", "method"), sumBy(m1, "rest_client_requests_total", "method")
	for verb, v := range b1 {
		if d := (v - b0[verb]) / wall; d > 0 {
			res.APIPerS[verb] = d
			res.APIPerSTotal += d
		}
	}
	if standby != nil {
		s1, err := scrape(ctx, standby.metrics)
		if err != nil {
			return err
		}
		res.StandbyAPIPerS = (value(s1, "rest_client_requests_total") - value(s0, "rest_client_requests_total")) / wall
	}
	const ops = "egressproxy_client_operation_duration_seconds_count"
	e0, e1 := sumBy(m0, ops, "egressproxy_entry"), sumBy(m1, ops, "egressproxy_entry")
	var total float64
	for e, v := range e1 {
		d := (v - e0[e]) / wall
		total += d
		res.CallsPerSMax = max(res.CallsPerSMax, d)
	}
	if len(e1) > 0 {
		res.CallsPerSEntry = total / float64(res.M)
	}
	res.CallsByOp = map[string]float64{}
	o0, o1 := sumBy(m0, ops, "egressproxy_operation"), sumBy(m1, ops, "egressproxy_operation")
	for op, v := range o1 {
		if d := (v - o0[op]) / wall; d > 0 {
			res.CallsByOp[op] = d
		}
	}
	const round = "egressproxy_operator_health_round_duration_seconds"
	n0, n1 := value(m0, round+"_count"), value(m1, round+"_count")
	sum0, sum1 := value(m0, round+"_sum"), value(m1, round+"_sum")
	if n1 > n0 {
		res.Rounds = int(n1 - n0)
		res.RoundS = (sum1 - sum0) / (n1 - n0)
	} else if n1 > 0 { // no round in the window: the mean since start
		res.Rounds = 0
		res.RoundS = sum1 / n1
	}
	res.RoundProxies = value(m1, "egressproxy_operator_health_round_proxies")
	if res.RoundS > 0 {
		res.ProbesPerS = res.RoundProxies / res.RoundS
	}
	return nil
}

// failover SIGKILLs the leader and waits for the standby to hold the
// Lease and for every object's status to be fresh (waitFresh).
func failover(ctx context.Context, o *options, res *runResult, c client.Client, leader, standby *process) error {
	res.Failover = true
	before, err := readLease(ctx, c)
	if err != nil {
		return err
	}
	if before.Spec.HolderIdentity == nil || *before.Spec.HolderIdentity == "" {
		return errors.New("no Lease holder before the kill")
	}
	holder := *before.Spec.HolderIdentity
	s0, err := scrape(ctx, standby.metrics)
	if err != nil {
		return err
	}
	killedAt := time.Now()
	if err := leader.kill(); err != nil {
		return err
	}
	// The killed holder's last renewal, read after the kill: nothing
	// renews it any more.
	l, err := readLease(ctx, c)
	if err != nil {
		return err
	}
	if l.Spec.LeaseDurationSeconds != nil && l.Spec.RenewTime != nil && l.Spec.HolderIdentity != nil && *l.Spec.HolderIdentity == holder {
		res.LeaseDurationS = float64(*l.Spec.LeaseDurationSeconds)
		res.LeaseExpiryS = l.Spec.RenewTime.Add(time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second).Sub(killedAt).Seconds()
	}
	var takenAt time.Time
	err = poll(ctx, o.timeout, 200*time.Millisecond, func() (bool, error) {
		if !standby.alive() {
			return false, fmt.Errorf("%s exited: %v", standby.name, standby.err)
		}
		l, err := readLease(ctx, c)
		if err != nil {
			return false, nil
		}
		if h := l.Spec.HolderIdentity; h != nil && *h != "" && *h != holder {
			takenAt = time.Now()
			return true, nil
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("the Lease: %w", err)
	}
	res.LeaseTakenS = takenAt.Sub(killedAt).Seconds()
	if err := waitFresh(ctx, o, res, c, standby, killedAt, s0); err != nil {
		return fmt.Errorf("fresh status: %w", err)
	}
	res.FreshS = time.Since(killedAt).Seconds()
	res.FreshAfterExpiry = res.FreshS - res.LeaseExpiryS
	return nil
}

// waitFresh waits until the new leader (standby, holding the Lease) has
// reconciled every object (its controller_runtime_reconcile_total of the
// egressproxy controller: it reconciles nothing before it leads), its
// tracker has decided every proxy healthy by its own probes
// (egressproxy_operator_health_proxies{state="healthy"}), and every
// object's status is Running and Healthy. s0 is the standby's metrics
// before the kill, for its status writes and Creates since.
func waitFresh(ctx context.Context, o *options, res *runResult, c client.Client, standby *process, killedAt time.Time, s0 []sample) error {
	n := float64(res.N)
	return poll(ctx, o.timeout, time.Second, func() (bool, error) {
		if !standby.alive() {
			return false, fmt.Errorf("%s exited: %v", standby.name, standby.err)
		}
		m, err := scrape(ctx, standby.metrics)
		if err != nil {
			return false, nil
		}
		since := time.Since(killedAt).Seconds()
		if res.ReconciledS == 0 && sumBy(m, "controller_runtime_reconcile_total", "controller")["egressproxy"] >= n {
			res.ReconciledS = since
		}
		if res.DecidedS == 0 && sumBy(m, "egressproxy_operator_health_proxies", "state")["healthy"] >= n {
			res.DecidedS = since
		}
		if res.ReconciledS == 0 || res.DecidedS == 0 {
			return false, nil
		}
		running, healthy, err := countStatus(ctx, c, time.Time{})
		if err != nil || running != res.N || healthy != res.N {
			return false, nil
		}
		res.FailoverPatches = sumBy(m, "rest_client_requests_total", "method")["PATCH"] - sumBy(s0, "rest_client_requests_total", "method")["PATCH"]
		const ops = "egressproxy_client_operation_duration_seconds_count"
		res.FailoverCreates = sumBy(m, ops, "egressproxy_operation")["create"] - sumBy(s0, ops, "egressproxy_operation")["create"]
		return true, nil
	})
}

func readLease(ctx context.Context, c client.Client) (*coordinationv1.Lease, error) {
	var l coordinationv1.Lease
	err := c.Get(ctx, client.ObjectKey{Namespace: operatorNS, Name: controller.LeaderElectionID}, &l)
	return &l, err
}

// operatorKubeconfig applies the operator's ClusterRole (config/rbac),
// binds it to operatorUser and writes a kubeconfig of that user.
func operatorKubeconfig(ctx context.Context, o *options, env *envtest.Environment, c client.Client, dir string) (string, error) {
	data, err := os.ReadFile(filepath.Join(o.moduleDir, "config", "rbac", "role.yaml"))
	if err != nil {
		return "", err
	}
	var role rbacv1.ClusterRole
	if err := yaml.UnmarshalStrict(data, &role); err != nil {
		return "", fmt.Errorf("config/rbac/role.yaml: %w", err)
	}
	if err := c.Create(ctx, &role); err != nil {
		return "", err
	}
	if err := c.Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: role.Name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: operatorUser}},
	}); err != nil {
		return "", err
	}
	u, err := env.AddUser(envtest.User{Name: operatorUser}, nil)
	if err != nil {
		return "", err
	}
	kc, err := u.KubeConfig()
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, "kubeconfig")
	return path, os.WriteFile(path, kc, 0o600)
}

// poll calls f every d until it reports done, fails, ctx ends or timeout
// passes.
func poll(ctx context.Context, timeout, d time.Duration, f func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		done, err := f()
		if err != nil || done {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not done within %v", timeout)
		}
		if err := sleep(ctx, d); err != nil {
			return err
		}
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
