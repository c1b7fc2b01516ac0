// Command egressproxy-operator runs the example egress-proxy operator
// against the cluster of the current kubeconfig (or in-cluster config):
//
//	egressproxy-operator --entries /etc/egressproxy/entries.yaml \
//	    --leader-election-namespace egressproxy-system \
//	    --connect-target example.com:443
//
// See the README for the entries file, the RBAC it needs, how errors
// become requeues, and the Deployment (config/default) that runs it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/otlptranslator"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/config"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/controller"
	"github.com/egressproxy/egressproxy/kvm2"

	// The Mozilla root certificates, used when the system has none (the
	// operator's image holds nothing but this binary): image URLs are
	// fetched over HTTPS.
	_ "golang.org/x/crypto/x509roots/fallback"
)

func main() {
	o, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "egressproxy-operator:", err)
		os.Exit(1)
	}
	log := newLogger(o)
	if err := run(o, log); err != nil {
		// Through the logger, like every line after the flags: a
		// JSON log stream stays parseable to its end.
		log.Error(err, "operator stopped")
		os.Exit(1)
	}
}

// newLogger is the operator's logger, as the --zap-* flags make it, and
// sets it as controller-runtime's and klog's.
//
// client-go and apimachinery log through klog wherever they find no
// logger in their context (controller-runtime puts one in the contexts of
// leader election and of its caches, not everywhere:
// utilruntime.HandleError, for one, logs through klog's global logger),
// and controller-runtime does not route klog: those lines would come out
// in klog's own text format ("E1204 21:07:02.580097 1 runtime.go:142] …")
// in the middle of a JSON stream. klog.SetLogger hands them to the
// operator's logger instead. The plain form, not SetLoggerWithOptions with
// ContextualLogger(true), keeps klog's verbosity gate: klog checks its own
// -v (0: the operator does not offer klog's flags) before a line reaches
// the logger, so client-go's V(1) and higher lines (request traces,
// lease renewals, watch details) stay out whatever --zap-log-level lets
// through of the library's and the reconciler's (debug: V(1); a number N:
// up to V(N)).
func newLogger(o *options) logr.Logger {
	log := zap.New(zap.UseFlagOptions(&o.zap))
	ctrl.SetLogger(log)
	klog.SetLogger(log.WithName("klog"))
	return log
}

// newMeterProvider is the MeterProvider the library's instruments record
// to. Its reader is OpenTelemetry's Prometheus exporter, registered with
// reg (controller-runtime's registry, which --metrics-bind-address
// serves), so one scrape has the library's series beside
// controller-runtime's own; names follow the exporter's Prometheus
// translation (egressproxy.client.operation.duration in seconds becomes
// egressproxy_client_operation_duration_seconds).
func newMeterProvider(reg prometheus.Registerer) (*sdkmetric.MeterProvider, error) {
	exp, err := otelprom.New(otelprom.WithRegisterer(reg), otelprom.WithTranslationStrategy(otlptranslator.UnderscoreEscapingWithSuffixes),
		// Every instrument's name is the library's own, so the scope
		// (the package that records it) tells a reader nothing the
		// name does not: no otel_scope_* labels on every series.
		otelprom.WithoutScopeInfo())
	if err != nil {
		return nil, err
	}
	return sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp)), nil
}

// options are the command line's settings.
type options struct {
	entries, leaderNS, target  string
	egressURL                  string
	metricsAddr, probeAddr     string
	healthEvery, gcEvery, poll time.Duration
	backoffBase, backoffMax    time.Duration
	permanentRetry             time.Duration
	workers                    int
	zap                        zap.Options
}

// parseFlags reads the command line (config/default's Deployment passes
// the same flags the end-to-end test does; TestDeploymentFlags parses the
// Deployment's with this function).
func parseFlags(args []string, stderr io.Writer) (*options, error) {
	var o options
	fs := flag.NewFlagSet("egressproxy-operator", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.entries, "entries", "", "the entries file (see the README); required")
	fs.StringVar(&o.leaderNS, "leader-election-namespace", "egressproxy-system", "namespace of the leader election Lease")
	fs.StringVar(&o.target, "connect-target", "example.com:443", "host:port the health probes CONNECT to through each proxy")
	fs.StringVar(&o.egressURL, "egress-url", "", `a "what is my address" URL (any HTTP(S) endpoint that answers with the caller's address) each health probe fetches through its proxy: the answer is status.egressAddress, a change an EgressAddressChanged event; "" fetches none`)
	fs.DurationVar(&o.healthEvery, "health-interval", controller.DefaultHealthInterval, "interval of health rounds")
	fs.DurationVar(&o.gcEvery, "gc-interval", controller.DefaultGCInterval, "interval of orphan collection")
	fs.DurationVar(&o.poll, "poll-interval", controller.DefaultPollInterval, "how often a VM without an address is read back (every 4 intervals once it has one)")
	fs.DurationVar(&o.backoffBase, "backoff-base", controller.DefaultBackoffBase, "first requeue delay after a Transient error (doubling per object)")
	fs.DurationVar(&o.backoffMax, "backoff-max", controller.DefaultBackoffMax, "longest requeue delay after Transient errors")
	fs.DurationVar(&o.permanentRetry, "permanent-retry", controller.DefaultPermanentRetry, "retry interval of an object whose last error was Permanent")
	fs.IntVar(&o.workers, "max-concurrent-reconciles", 0, "how many objects are reconciled at once; 0: 4 per entry (at least 4)")
	fs.StringVar(&o.metricsAddr, "metrics-bind-address", "0", `address of the metrics endpoint (e.g. ":8080"); "0" serves none`)
	fs.StringVar(&o.probeAddr, "health-probe-bind-address", "0", `address of the liveness and readiness endpoints /healthz and /readyz (e.g. ":8081"); "0" serves none`)
	o.zap.BindFlags(fs)
	config.RegisterFlags(fs) // --kubeconfig, which ctrl.GetConfig reads
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q (flags only)", fs.Args())
	}
	if o.entries == "" {
		return nil, errors.New("--entries is required")
	}
	return &o, nil
}

func run(o *options, log logr.Logger) error {
	mp, err := newMeterProvider(ctrlmetrics.Registry)
	if err != nil {
		return err
	}
	defer func() { _ = mp.Shutdown(context.Background()) }()

	data, err := os.ReadFile(o.entries)
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
	cfgs, mems, entryLabels, err := controller.LoadEntriesFile(lctx, direct, data)
	cancel()
	if err != nil {
		return err
	}
	clients, err := controller.OpenEntries(ctx, cfgs, &kvm2.Options{Logger: log, MeterProvider: mp})
	if err != nil {
		return err
	}
	defer controller.CloseEntries(clients)
	if err := controller.OpenMemoryEntries(mems, controller.MemoryOptions{Logger: log, MeterProvider: mp}, clients); err != nil {
		return err
	}

	mgr, err := newManager(o, restCfg, scheme, log, mp, clients, entryLabels)
	if err != nil {
		return err
	}
	return mgr.Start(ctx)
}

// newManager is the manager with the operator's controllers and the
// health endpoints: /healthz answers while the process serves, /readyz
// once the manager's caches have synced (every replica, leader or not, is
// ready: a standby is ready to take over).
func newManager(o *options, restCfg *rest.Config, scheme *runtime.Scheme, log logr.Logger, mp metric.MeterProvider, clients map[string]*egressproxy.Client, entryLabels map[string]map[string]string) (ctrl.Manager, error) {
	mopts := controller.ManagerOptions(o.leaderNS)
	mopts.Scheme = scheme
	// The metrics port also serves the pools' endpoints as JSON
	// (controller.DiscoveryPath), read straight from the apiserver.
	direct, err := client.New(restCfg, client.Options{Scheme: scheme})
	if err != nil {
		return nil, err
	}
	mopts.Metrics = metricsserver.Options{BindAddress: o.metricsAddr, ExtraHandlers: map[string]http.Handler{
		controller.DiscoveryPath: controller.DiscoveryHandler(direct, log.WithName("discovery")),
	}}
	mopts.HealthProbeBindAddress = o.probeAddr
	mgr, err := ctrl.NewManager(restCfg, mopts)
	if err != nil {
		return nil, err
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return nil, err
	}
	if err := mgr.AddReadyzCheck("informers", func(req *http.Request) error {
		if !mgr.GetCache().WaitForCacheSync(req.Context()) {
			return errors.New("informer caches not synced")
		}
		return nil
	}); err != nil {
		return nil, err
	}
	if _, _, err := controller.Setup(mgr, controller.Config{
		Entries:     clients,
		EntryLabels: entryLabels,
		Reconciler: controller.Options{
			BackoffBase: o.backoffBase, BackoffMax: o.backoffMax, PollInterval: o.poll,
			PermanentRetry: o.permanentRetry, MaxConcurrentReconciles: o.workers,
		},
		Health: controller.HealthOptions{Interval: o.healthEvery, ConnectTarget: o.target, EgressURL: o.egressURL, MeterProvider: mp},
		GC:     controller.GCOptions{Interval: o.gcEvery},
		Logger: log,
	}); err != nil {
		return nil, err
	}
	return mgr, nil
}
