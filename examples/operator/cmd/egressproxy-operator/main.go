// Command egressproxy-operator runs the example egress-proxy operator
// against the cluster of the current kubeconfig (or in-cluster config):
//
//	egressproxy-operator --entries /etc/egressproxy/entries.yaml \
//	    --leader-election-namespace egressproxy-system \
//	    --connect-target example.com:443
//
// See the README for the entries file, the RBAC it needs and how errors
// become requeues.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/controller"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "egressproxy-operator:", err)
		os.Exit(1)
	}
}

func run() error {
	entries := flag.String("entries", "", "the entries file (see the README); required")
	leaderNS := flag.String("leader-election-namespace", "egressproxy-system", "namespace of the leader election Lease")
	target := flag.String("connect-target", "example.com:443", "host:port the health probes CONNECT to through each proxy")
	healthEvery := flag.Duration("health-interval", controller.DefaultHealthInterval, "interval of health rounds")
	gcEvery := flag.Duration("gc-interval", controller.DefaultGCInterval, "interval of orphan collection")
	poll := flag.Duration("poll-interval", controller.DefaultPollInterval, "how often a VM without an address is read back (every 4 intervals once it has one)")
	backoffBase := flag.Duration("backoff-base", controller.DefaultBackoffBase, "first requeue delay after a Transient error (doubling per object)")
	backoffMax := flag.Duration("backoff-max", controller.DefaultBackoffMax, "longest requeue delay after Transient errors")
	permanentRetry := flag.Duration("permanent-retry", controller.DefaultPermanentRetry, "retry interval of an object whose last error was Permanent")
	workers := flag.Int("max-concurrent-reconciles", controller.DefaultMaxConcurrentReconciles, "how many objects are reconciled at once")
	metricsAddr := flag.String("metrics-bind-address", "0", `address of the metrics endpoint (e.g. ":8080"); "0" serves none`)
	zo := zap.Options{}
	zo.BindFlags(flag.CommandLine)
	flag.Parse()
	if *entries == "" {
		return fmt.Errorf("--entries is required")
	}
	log := zap.New(zap.UseFlagOptions(&zo))
	ctrl.SetLogger(log)

	data, err := os.ReadFile(*entries)
	if err != nil {
		return err
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return err
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return err
	}
	restCfg, err := ctrl.GetConfig()
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	// The entries' credentials are read once at start, straight from the
	// apiserver (a rotated key takes a restart, as a changed entries file
	// does).
	direct, err := client.New(restCfg, client.Options{Scheme: scheme})
	if err != nil {
		return err
	}
	lctx, cancel := context.WithTimeout(ctx, time.Minute)
	cfgs, err := controller.LoadEntries(lctx, direct, data)
	cancel()
	if err != nil {
		return err
	}
	clients, err := controller.OpenEntries(ctx, cfgs, log)
	if err != nil {
		return err
	}
	defer controller.CloseEntries(clients)

	opts := controller.ManagerOptions(*leaderNS)
	opts.Scheme = scheme
	opts.Metrics = metricsserver.Options{BindAddress: *metricsAddr}
	mgr, err := ctrl.NewManager(restCfg, opts)
	if err != nil {
		return err
	}
	if _, _, err := controller.Setup(mgr, controller.Config{
		Entries: clients,
		Reconciler: controller.Options{
			BackoffBase: *backoffBase, BackoffMax: *backoffMax, PollInterval: *poll,
			PermanentRetry: *permanentRetry, MaxConcurrentReconciles: *workers,
		},
		Health: controller.HealthOptions{Interval: *healthEvery, ConnectTarget: *target},
		GC:     controller.GCOptions{Interval: *gcEvery},
		Logger: log,
	}); err != nil {
		return err
	}
	return mgr.Start(ctx)
}
