// Command scale measures how the example operator scales with the number of
// EgressProxy objects and writes docs/scale.md (issue 36's figures).
//
// Each run (-runs N:M,…) starts a real kube-apiserver and etcd (envtest,
// with the binaries scripts/kubestack builds), installs the CRDs and the
// operator's ClusterRole, serves M memory entries from a memory host in
// this process (internal/memhost: each call waits -call-delay, each VM is
// a real loopback CONNECT proxy, and the VMs outlive the operator, as a
// kvm2 entry's do), creates N EgressProxy objects spread over them, runs
// the real operator binary (built from cmd/egressproxy-operator as the
// image has it) as a process with an entries file that names the memory
// host's entries (controller.MemoryEntry.Endpoint), and measures:
//
//   - converge: from the process's start until every object's status is
//     Running and Healthy;
//   - at rest over -rest (after -settle): the leader's CPU (cores, from
//     /proc/PID/stat), RSS (/proc/PID/status), goroutines (go_goroutines),
//     its apiserver requests per second by verb (client-go's
//     rest_client_requests_total on its /metrics), library calls per
//     second per entry (egressproxy_client_operation_duration_seconds_count),
//     and the wall time of its health rounds
//     (egressproxy_operator_health_round_duration_seconds);
//   - failover: a second replica runs beside the leader during the rest
//     window; the leader is SIGKILLed; the time until the second replica
//     holds the Lease and until every object's status is fresh again: the
//     new leader has reconciled every object
//     (controller_runtime_reconcile_total), decided every proxy healthy by
//     its own probes (egressproxy_operator_health_proxies), and every
//     status is Running and Healthy; with its status writes and Creates
//     meanwhile (none, when the VMs survived and nothing changed).
//
// Run it from examples/operator with the control plane built:
//
//	eval "$(../../scripts/kubestack env)"
//	nice -n 19 go run ./cmd/scale -runs 200:2,500:5 -rest 60s -out ../../docs/scale.md
//
// -merge keeps the runs of -out that this invocation does not measure
// (they are stored in the report as JSON, in a comment at its end).
// Beside the report goes its growth plot (scale.md → scale.svg, plot.go);
// -rerender writes both again from the stored runs without measuring.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/egressproxy/egressproxy/examples/operator/internal/ociimage"
)

// options are the command line's settings.
type options struct {
	runs           []runSpec
	callDelay      time.Duration
	rest, settle   time.Duration
	healthInterval time.Duration
	timeout        time.Duration
	workers        int
	failover       bool
	inProcess      bool
	out, command   string
	merge          bool
	moduleDir      string
	kubestack      string
	logDir         string
	note           string
	analysis       string
	rerender       bool
	check          string
}

// runSpec is one run's size: N objects over M memory entries.
type runSpec struct{ N, M int }

func parseRuns(s string) ([]runSpec, error) {
	var out []runSpec
	for _, f := range strings.Split(s, ",") {
		ns, ms, ok := strings.Cut(strings.TrimSpace(f), ":")
		n, err1 := strconv.Atoi(ns)
		m, err2 := strconv.Atoi(ms)
		if !ok || err1 != nil || err2 != nil || n < 1 || m < 1 || m > n {
			return nil, fmt.Errorf("-runs: %q: want N:M with 1 <= M <= N", f)
		}
		out = append(out, runSpec{N: n, M: m})
	}
	return out, nil
}

func main() {
	var o options
	runs := flag.String("runs", "200:2,500:5", "runs as N:M (objects:memory entries), comma-separated")
	flag.DurationVar(&o.callDelay, "call-delay", 50*time.Millisecond, "simulated round trip of every library call on the memory entries")
	flag.DurationVar(&o.rest, "rest", 5*time.Minute, "the at-rest window")
	flag.DurationVar(&o.settle, "settle", 15*time.Second, "wait after convergence before the at-rest window starts")
	flag.DurationVar(&o.healthInterval, "health-interval", 30*time.Second, "the operator's --health-interval (its default: 30s)")
	flag.DurationVar(&o.timeout, "timeout", 20*time.Minute, "longest wait for convergence, and for failover")
	flag.IntVar(&o.workers, "max-concurrent-reconciles", 0, "the operator's --max-concurrent-reconciles (0: its default)")
	flag.BoolVar(&o.failover, "failover", true, "run a second replica and measure the failover")
	flag.BoolVar(&o.inProcess, "in-process", false, "memory entries in the operator's process (each replica its own VMs, which die with it), not on a memory host: to measure what the memory host's HTTP hop costs")
	flag.StringVar(&o.out, "out", "../../docs/scale.md", "the report to write")
	flag.StringVar(&o.command, "command", "", "the command recorded in the report (default: this one's arguments)")
	flag.BoolVar(&o.merge, "merge", false, "keep the runs of -out this invocation does not measure")
	flag.StringVar(&o.moduleDir, "module-dir", ".", "the operator module's directory (config/crd, config/rbac, cmd/egressproxy-operator)")
	flag.StringVar(&o.kubestack, "kubestack", "../../scripts/kubestack", "scripts/kubestack, asked for the control plane when KUBEBUILDER_ASSETS is unset")
	flag.StringVar(&o.logDir, "log-dir", "", "where the operators' logs go (default: a temporary directory, removed on success)")
	flag.StringVar(&o.note, "note", "", "a line about the machine and the session for the report (what else ran, why no larger N)")
	flag.StringVar(&o.analysis, "analysis", "cmd/scale/analysis.md", "hand-written reading appended to the report ('' for none)")
	flag.BoolVar(&o.rerender, "rerender", false, "measure nothing: write -out and its growth plot (-out's .md as .svg) again from the runs it stores (with -note and -analysis; the recorded command stays -command)")
	flag.StringVar(&o.check, "check", "", "the CI variant: measure, compare each figure with the one this report documents (scaled linearly to the run's N) and fail when one is more than 2× worse; writes nothing (defaults: -runs 200:2 -rest 15s -settle 2s -health-interval 15s -failover=false)")
	flag.Parse()
	if o.check != "" {
		set := map[string]bool{}
		flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
		for name, v := range map[string]string{"runs": "200:2", "rest": "15s", "settle": "2s", "health-interval": "15s", "failover": "false", "timeout": "2m"} {
			if !set[name] {
				if err := flag.Set(name, v); err != nil {
					panic(err)
				}
			}
		}
		if set["rerender"] || set["merge"] {
			fmt.Fprintln(os.Stderr, "scale: -check writes nothing: -rerender and -merge do not apply")
			os.Exit(2)
		}
	}
	var err error
	if o.runs, err = parseRuns(*runs); err != nil {
		fmt.Fprintln(os.Stderr, "scale:", err)
		os.Exit(2)
	}
	if o.command == "" {
		args := make([]string, len(os.Args)-1)
		for i, a := range os.Args[1:] {
			args[i] = a
			if strings.ContainsAny(a, " \"'$") {
				args[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
			}
		}
		o.command = "go run ./cmd/scale " + strings.Join(args, " ")
	}
	logf.SetLogger(logr.Discard())
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, &o); err != nil {
		fmt.Fprintln(os.Stderr, "scale:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, o *options) error {
	if o.check != "" {
		return check(ctx, o)
	}
	rep := &report{Command: o.command, CallDelay: o.callDelay, Rest: o.rest, HealthInterval: o.healthInterval, Machine: describeMachine(), Note: o.note}
	if o.analysis != "" {
		b, err := os.ReadFile(o.analysis)
		if err != nil {
			return err
		}
		rep.Analysis = string(b)
	}
	if o.rerender {
		runs, err := readRuns(o.out)
		if err != nil {
			return err
		}
		rep.Runs = runs
		return writeReport(o.out, rep)
	}
	assets, err := controlPlaneAssets(o.kubestack)
	if err != nil {
		return err
	}
	if o.merge {
		if prev, err := readRuns(o.out); err == nil {
			rep.Runs = prev
		} else if !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("-merge: %w", err)
		}
	}
	logDir := o.logDir
	if logDir == "" {
		if logDir, err = os.MkdirTemp("", "egressproxy-scale-"); err != nil {
			return err
		}
	} else if err := os.MkdirAll(logDir, 0o755); err != nil {
		return err
	}
	bin := filepath.Join(logDir, "egressproxy-operator")
	t0 := time.Now()
	if err := ociimage.BuildBinary(ctx, o.moduleDir, bin); err != nil {
		return err
	}
	logf0("built the operator in %v", time.Since(t0).Round(100*time.Millisecond))
	for _, rs := range o.runs {
		res, err := runOne(ctx, o, assets, bin, logDir, rs)
		if err != nil {
			return fmt.Errorf("run N=%d M=%d: %w (logs in %s)", rs.N, rs.M, err, logDir)
		}
		rep.add(res)
		// Written after every run: a later run that fails keeps the
		// earlier ones.
		if err := writeReport(o.out, rep); err != nil {
			return err
		}
		logf0("N=%d M=%d: converged in %.1fs; wrote %s", rs.N, rs.M, res.ConvergeS, o.out)
	}
	if o.logDir == "" {
		_ = os.RemoveAll(logDir)
	}
	return nil
}

// check is -check: it measures the runs, prints every figure beside the
// documented one and fails naming each that is more than checkLimit times
// worse. It writes no report.
func check(ctx context.Context, o *options) error {
	doc, err := readRuns(o.check)
	if err != nil {
		return fmt.Errorf("-check: %w", err)
	}
	assets, err := controlPlaneAssets(o.kubestack)
	if err != nil {
		return err
	}
	logDir := o.logDir
	if logDir == "" {
		if logDir, err = os.MkdirTemp("", "egressproxy-scale-check-"); err != nil {
			return err
		}
	} else if err := os.MkdirAll(logDir, 0o755); err != nil {
		return err
	}
	bin := filepath.Join(logDir, "egressproxy-operator")
	t0 := time.Now()
	if err := ociimage.BuildBinary(ctx, o.moduleDir, bin); err != nil {
		return err
	}
	logf0("built the operator in %v", time.Since(t0).Round(100*time.Millisecond))
	var failed []string
	for _, rs := range o.runs {
		res, err := runOne(ctx, o, assets, bin, logDir, rs)
		if err != nil {
			return fmt.Errorf("run N=%d M=%d: %w (logs in %s)", rs.N, rs.M, err, logDir)
		}
		rows, bad := compare(doc, res, checkFigures(), checkLimit)
		printCheck(os.Stdout, rs.N, rs.M, rows, checkLimit)
		fmt.Printf("  (apiserver requests by verb %s; library calls by operation %s; health rounds in the window %d)\n",
			byKey(res.APIPerS, "%.2f/s"), byKey(res.CallsByOp, "%.2f/s"), res.Rounds)
		for _, b := range bad {
			failed = append(failed, fmt.Sprintf("N=%d: %s", rs.N, b))
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("-check %s: %d figure(s) regressed or unchecked: %s (logs in %s)", o.check, len(failed), strings.Join(failed, "; "), logDir)
	}
	if o.logDir == "" {
		_ = os.RemoveAll(logDir)
	}
	return nil
}

// logf0 prints a progress line to stderr.
func logf0(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s scale: %s\n", time.Now().UTC().Format("15:04:05"), fmt.Sprintf(format, args...))
}

// sortRuns orders runs by N, then M.
func sortRuns(rs []*runResult) {
	sort.Slice(rs, func(i, j int) bool {
		if rs[i].N != rs[j].N {
			return rs[i].N < rs[j].N
		}
		return rs[i].M < rs[j].M
	})
}
