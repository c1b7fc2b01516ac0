//go:build integration

package kvm2

import (
	"bufio"
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/google/go-cmp/cmp"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/testing/metrictest"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// memTotal is this machine's MemTotal in bytes (the stack's libvirtd runs
// here).
func memTotal(t *testing.T) int64 {
	t.Helper()
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kib, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kib << 10
		}
	}
	t.Fatal("no MemTotal in /proc/meminfo")
	return 0
}

// On the real stack, one entry opened with a MeterProvider: after a Check,
// a List and a Get of a missing instance, every series carries the entry;
// the client's operations, the libvirt calls (by procedure, the missing
// domain NotFound), the SSH connection's state and the Check's facts are
// there with the values the host gives. After the SSH link is killed, the
// state is disconnected, and the next Check redials.
func TestIntegrationMetrics(t *testing.T) {
	cfg := stackConfig(t)
	cfg.Entry = "itmetrics"
	rd := metrictest.New(t)
	opts := &Options{MeterProvider: rd.MeterProvider()}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := open(ctx, cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	c := driver.NewClient(p, clientOptions(p.cfg, opts))
	defer c.Close()

	h, err := c.Check(ctx)
	if err != nil || !h.Reachable || h.Capacity == nil {
		t.Fatalf("Check = %+v, %v; want Reachable with a Capacity", h, err)
	}
	t.Logf("capacity %+v", *h.Capacity)
	if cp := h.Capacity; cp.CPUs < 1 || cp.MemoryAvailableBytes <= 0 || cp.MemoryAvailableBytes > memTotal(t) || cp.Instances != 0 || cp.PoolAvailableBytes <= 0 {
		t.Errorf("Capacity %+v: want CPUs, memory within MemTotal, no instance of a new entry, pool space", *cp)
	}
	if _, err := c.List(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, egressproxy.Ref{Name: "nope", UID: "u"}); egressproxy.Code(err) != egressproxy.NotFound {
		t.Fatalf("Get of a missing instance: %v", err)
	}

	all := rd.Collect(t)
	counts := map[string]uint64{} // histogram series → count
	values := map[string]float64{}
	for _, s := range all {
		if s.Attrs["egressproxy.entry"] != cfg.Entry {
			t.Errorf("%s: not labelled with the entry", s.Key())
		}
		delete(s.Attrs, "egressproxy.entry")
		if s.Kind == metrictest.Histogram {
			counts[s.Key()] = s.Count
		} else {
			values[s.Key()] = s.Value
		}
	}
	for _, w := range []struct {
		name  string
		attrs map[string]string
		count uint64
	}{
		{obs.MetricClientOperationDuration, map[string]string{"egressproxy.operation": "check"}, 1},
		{obs.MetricClientOperationDuration, map[string]string{"egressproxy.operation": "list"}, 1},
		{obs.MetricClientOperationDuration, map[string]string{"egressproxy.operation": "get", "error.type": "NotFound"}, 1},
		{obs.MetricLibvirtRPCDuration, map[string]string{"rpc.method": "ConnectOpen"}, 1},
		{obs.MetricLibvirtRPCDuration, map[string]string{"rpc.method": "ConnectGetHostname"}, 1},
		{obs.MetricLibvirtRPCDuration, map[string]string{"rpc.method": "NodeGetInfo"}, 1},
		{obs.MetricLibvirtRPCDuration, map[string]string{"rpc.method": "NodeGetMemoryStats"}, 2},
		{obs.MetricLibvirtRPCDuration, map[string]string{"rpc.method": "ConnectGetAllDomainStats"}, 2}, // Check and List
		{obs.MetricLibvirtRPCDuration, map[string]string{"rpc.method": "DomainLookupByName", "error.type": "NotFound"}, 1},
	} {
		if got := counts[metrictest.Key(w.name, w.attrs)]; got != w.count {
			t.Errorf("%s: count %d, want %d", metrictest.Key(w.name, w.attrs), got, w.count)
		}
	}
	wantValues := map[string]float64{
		metrictest.Key(obs.MetricEntryReachable, nil):                                                         1,
		metrictest.Key(obs.MetricEntryCPUCount, nil):                                                          float64(h.Capacity.CPUs),
		metrictest.Key(obs.MetricEntryMemoryAvailable, nil):                                                   float64(h.Capacity.MemoryAvailableBytes),
		metrictest.Key(obs.MetricEntryInstanceCount, nil):                                                     0,
		metrictest.Key(obs.MetricEntryPoolAvailable, nil):                                                     float64(h.Capacity.PoolAvailableBytes),
		metrictest.Key(obs.MetricSSHConnectionState, map[string]string{"egressproxy.ssh.state": "connected"}): 1,
	}
	if d := cmp.Diff(wantValues, values); d != "" {
		t.Errorf("gauges and counters (-want +got):\n%s", d)
	}

	// The link dies; the next Check redials it.
	pool := p.lv.(*sshSession).pool
	sc, err := pool.Client(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pool.Kill(sc, errors.New("killed by the test"))
	<-pool.Done(sc)
	state := func() map[string]float64 {
		out := map[string]float64{}
		for _, s := range rd.Collect(t) {
			if s.Name == obs.MetricSSHConnectionState || s.Name == obs.MetricSSHRedials {
				out[s.Name+" "+s.Attrs["egressproxy.ssh.state"]] = s.Value
			}
		}
		return out
	}
	if d := cmp.Diff(map[string]float64{obs.MetricSSHConnectionState + " disconnected": 1}, state()); d != "" {
		t.Errorf("after the link died (-want +got):\n%s", d)
	}
	if h, err := c.Check(ctx); err != nil || !h.Reachable {
		t.Fatalf("Check after the link died = %+v, %v", h, err)
	}
	if d := cmp.Diff(map[string]float64{obs.MetricSSHConnectionState + " connected": 1, obs.MetricSSHRedials + " ": 1}, state()); d != "" {
		t.Errorf("after the redial (-want +got):\n%s", d)
	}
}

// On the real stack, an entry opened with a MeterProvider: a cold Create
// fetches the image from the mirror, so its bytes count under source
// mirror and the entry holds one base of the image's size; once the proxy
// is deleted, EvictImage counts one eviction and the entry holds no base;
// after Close the bases' gauges are absent. Every image series carries the
// entry and no other attribute than its source.
func TestIntegrationImageMetrics(t *testing.T) {
	teststack.Require(t)
	e := newLifecycleEnv(t)
	rd := metrictest.New(t)
	opts := &Options{MeterProvider: rd.MeterProvider(), Logger: testr.NewWithOptions(t, testr.Options{Verbosity: 1})}
	ctx := ctxT(t)
	p, err := open(ctx, e.cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	c := driver.NewClient(p, clientOptions(p.cfg, opts))
	closed := false
	defer func() {
		if !closed {
			_ = c.Close()
		}
	}()
	image := func() map[string]string {
		out := map[string]string{}
		for _, s := range rd.Collect(t) {
			if !strings.HasPrefix(s.Name, "egressproxy.image.") {
				continue
			}
			if s.Attrs["egressproxy.entry"] != e.cfg.Entry {
				t.Errorf("%s: not labelled with the entry", s.Key())
			}
			delete(s.Attrs, "egressproxy.entry")
			out[s.Key()] = s.Text()
		}
		return out
	}

	spec := egressproxy.Spec{Name: "metrics-it", UID: "uid-metrics-it"}
	if _, err := c.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	size := strconv.Itoa(len(teststack.TinyQCOW2(t)))
	mirror := map[string]string{"egressproxy.image.source": "mirror"}
	want := map[string]string{
		metrictest.Key(obs.MetricImageTransferSize, mirror):  size,
		metrictest.Key(obs.MetricImageFetchDuration, mirror): "count 1",
		metrictest.Key(obs.MetricImageBaseCount, nil):        "1",
		metrictest.Key(obs.MetricImageBaseUsage, nil):        size,
	}
	if d := cmp.Diff(want, image()); d != "" {
		t.Fatalf("after a cold Create (-want +got):\n%s", d)
	}
	if err := c.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}
	if err := c.EvictImage(ctx, "tiny"); err != nil {
		t.Fatal(err)
	}
	want[metrictest.Key(obs.MetricImageEvictions, nil)] = "1"
	want[metrictest.Key(obs.MetricImageBaseCount, nil)] = "0"
	want[metrictest.Key(obs.MetricImageBaseUsage, nil)] = "0"
	if d := cmp.Diff(want, image()); d != "" {
		t.Fatalf("after EvictImage (-want +got):\n%s", d)
	}
	closed = true
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	delete(want, metrictest.Key(obs.MetricImageBaseCount, nil))
	delete(want, metrictest.Key(obs.MetricImageBaseUsage, nil))
	if d := cmp.Diff(want, image()); d != "" {
		t.Fatalf("after Close (-want +got):\n%s", d)
	}
}
