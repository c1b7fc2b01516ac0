package libvirtconn

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/google/go-cmp/cmp"
	"go.opentelemetry.io/otel/attribute"

	"github.com/egressproxy/egressproxy/internal/libvirterr"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/metrictest"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
)

// rpcCounts maps "method error.type" of each series of the RPC histogram
// to its count, checking the instrument's shape and the entry on the way.
func rpcCounts(t *testing.T, rd *metrictest.Reader) map[string]uint64 {
	t.Helper()
	out := map[string]uint64{}
	for _, s := range rd.Collect(t) {
		if s.Name != obs.MetricLibvirtRPCDuration || s.Kind != metrictest.Histogram || s.Unit != "s" || s.Scope != meterName {
			t.Errorf("%s: kind %s unit %q scope %q, want only the histogram %s in s of %s", s.Key(), s.Kind, s.Unit, s.Scope, obs.MetricLibvirtRPCDuration, meterName)
		}
		if s.Attrs["egressproxy.entry"] != "e1" {
			t.Errorf("%s: no egressproxy.entry e1", s.Key())
		}
		out[s.Attrs["rpc.method"]+" "+s.Attrs["error.type"]] = s.Count
	}
	return out
}

// Every remote procedure call of the session's connections is measured
// once, by procedure, with its class when libvirtd answered an error: the
// shared connection's connect and calls, a dedicated connection's
// go-libvirt calls, its own stream call and its disconnect.
func TestMetricsRPC(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "hyper-1")
	rd := metrictest.New(t)
	_, s := newSession(t, f, lvd, nil, &Options{MeterProvider: rd.MeterProvider(),
		MetricAttributes: []attribute.KeyValue{obs.KeyEntry.String("e1")}})
	ctx := context.Background()
	for i := range 3 {
		if _, err := hostname(ctx, s); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	err := s.Do(ctx, func(l *libvirt.Libvirt) error {
		_, err := l.DomainLookupByName("missing")
		return err
	})
	if n, ok := libvirterr.Number(err); !ok || n != libvirt.ErrNoDomain {
		t.Fatalf("DomainLookupByName: %v, want libvirt's no-domain error", err)
	}
	want := map[string]uint64{
		"AuthList ":                   1,
		"ConnectOpen ":                1,
		"ConnectGetHostname ":         3,
		"DomainLookupByName NotFound": 1,
	}
	if d := cmp.Diff(want, rpcCounts(t, rd)); d != "" {
		t.Errorf("the shared connection's calls (-want +got):\n%s", d)
	}

	d, err := s.Dedicated(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := d.StorageVolDownload(testVol, &buf, 0, 0, 0); err != nil {
		t.Fatalf("download: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	want["AuthList "]++
	want["ConnectOpen "]++
	want["StorageVolDownload "] = 1
	want["ConnectClose "] = 1
	if d := cmp.Diff(want, rpcCounts(t, rd)); d != "" {
		t.Errorf("after a dedicated connection's download (-want +got):\n%s", d)
	}
}

// A call whose connection is lost before its reply is measured once, as
// Transient (a lost link's class).
func TestMetricsRPCLost(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "hyper-1")
	rd := metrictest.New(t)
	_, s := newSession(t, f, lvd, nil, &Options{MeterProvider: rd.MeterProvider(),
		MetricAttributes: []attribute.KeyValue{obs.KeyEntry.String("e1")}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := hostname(ctx, s); err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	lvd.whenHeld(t, lvd.DropAll)
	if _, err := hostname(ctx, s); err == nil {
		t.Fatal("a call whose connection was dropped succeeded")
	}
	want := map[string]uint64{
		"AuthList ":                    1,
		"ConnectOpen ":                 1,
		"ConnectGetHostname ":          1,
		"ConnectGetHostname Transient": 1,
	}
	if !eventually.Poll(ctx, 10*time.Second, func() bool { return cmp.Equal(want, rpcCounts(t, rd)) }) {
		t.Errorf("RPC series (-want +got):\n%s", cmp.Diff(want, rpcCounts(t, rd)))
	}
}

// Without a MeterProvider the guard tracks no call.
func TestMetricsRPCOff(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "hyper-1")
	_, s := newSession(t, f, lvd, nil, nil)
	if _, err := hostname(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	c := s.cur
	s.mu.Unlock()
	if c.guard.own.rpc != nil {
		t.Error("the guard tracks calls without a MeterProvider")
	}
}

// Every procedure name comes from the generated table; others are _OTHER.
func TestProcName(t *testing.T) {
	for _, tc := range []struct {
		program, proc uint32
		want          string
	}{
		{remoteProgram, 1, "ConnectOpen"},
		{remoteProgram, 59, "ConnectGetHostname"},
		{remoteProgram, procStorageVolUpload, "StorageVolUpload"},
		{remoteProgram, 6, "NodeGetInfo"},
		{remoteProgram, 228, "NodeGetMemoryStats"},
		{remoteProgram, 1 << 20, "_OTHER"},
		{remoteProgram, 0, "_OTHER"},
		{0x20008087, 1, "_OTHER"}, // the qemu program
	} {
		if got := procName(tc.program, tc.proc); got != tc.want {
			t.Errorf("procName(%#x, %d) = %q, want %q", tc.program, tc.proc, got, tc.want)
		}
	}
}
