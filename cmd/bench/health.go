package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"

	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

type healthResult struct {
	benchCmd                string
	inproc                  map[string][]float64 // metric unit -> values (one per -count run)
	squidRate, squidAllocs  []float64
	authRate, authAllocs    []float64
	probeAllocs, probeBytes float64
	probes, workers         int
}

const healthBench = "BenchmarkProbe1000Proxies/workers=32$"

// runHealth runs health's own BenchmarkProbe1000Proxies (1,000 in-process
// CONNECT responders) -runs times, then ProbeAll rounds through the stack's
// Squid (open and authenticating port) to a loopback sink.
func runHealth(ctx context.Context, env teststack.Env, o options) (*healthResult, error) {
	res := &healthResult{inproc: map[string][]float64{}, probes: o.probes, workers: 32}
	args := []string{"test", "-run", "^$", "-bench", healthBench, "-benchtime", "1s", "-count", strconv.Itoa(o.runs), "./health/"}
	res.benchCmd = "go " + strings.Join(args, " ")
	logf("health: %s", res.benchCmd)
	out, err := exec.CommandContext(ctx, "go", args...).CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("%s: %w: %s", res.benchCmd, err, out)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "BenchmarkProbe1000Proxies/workers=32") {
			continue
		}
		for i := 2; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err == nil {
				res.inproc[f[i+1]] = append(res.inproc[f[i+1]], v)
			}
		}
	}
	if len(res.inproc["probes/s"]) == 0 {
		return nil, fmt.Errorf("no probes/s in the benchmark output: %s", out)
	}

	sink, err := benchutil.NewSinkTarget()
	if err != nil {
		return nil, err
	}
	defer sink.Close()
	for _, px := range []struct {
		addr          string
		rate, allocs  *[]float64
		authenticated bool
	}{{env.SquidAddr, &res.squidRate, &res.squidAllocs, false}, {env.SquidAuthAddr, &res.authRate, &res.authAllocs, true}} {
		round := func() benchutil.ProbeRound {
			if px.authenticated {
				return benchutil.ProbeThroughAuth(ctx, px.addr, sink.Addr, env.SquidUser, env.SquidPassword, o.probes, res.workers)
			}
			return benchutil.ProbeThrough(ctx, px.addr, sink.Addr, o.probes, res.workers)
		}
		if r := round(); r.Failed > 0 { // warm-up
			return nil, fmt.Errorf("squid %s: %d of %d probes failed, first: %v", px.addr, r.Failed, r.Probes, r.FirstFailure)
		}
		for range o.runs {
			r := round()
			if r.Failed > 0 {
				return nil, fmt.Errorf("squid %s: %d of %d probes failed, first: %v", px.addr, r.Failed, r.Probes, r.FirstFailure)
			}
			*px.rate = append(*px.rate, r.PerSecond)
			*px.allocs = append(*px.allocs, r.AllocsPerOp)
		}
		logf("health: squid %s: %v probes/s", px.addr, *px.rate)
	}
	res.probeAllocs, res.probeBytes = benchutil.ProbeAllocs(ctx, env.SquidAddr, sink.Addr, o.probes, res.workers)
	return res, nil
}
