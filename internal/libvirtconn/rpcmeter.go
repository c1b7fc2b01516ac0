package libvirtconn

//go:generate go run gen_procnames.go

import (
	"context"
	"encoding/binary"
	"sync"
	"time"

	"github.com/digitalocean/go-libvirt/socket"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirterr"
	"github.com/egressproxy/egressproxy/internal/obs"
)

// meterName is the instrumentation scope of the libvirt RPC metrics: kvm2,
// the package whose entries make the calls.
const meterName = "github.com/egressproxy/egressproxy/kvm2"

// rpcMeter records the duration of every remote procedure call of a
// Session's connections (the shared one and the dedicated ones), from the
// call's header leaving to its reply arriving, by procedure and, for a
// call that failed, its error's class. A nil *rpcMeter records nothing.
type rpcMeter struct {
	hist  metric.Float64Histogram
	attrs []attribute.KeyValue // the Session's MetricAttributes, cleaned
}

func newRPCMeter(mp metric.MeterProvider, attrs []attribute.KeyValue) *rpcMeter {
	if mp == nil {
		return nil
	}
	return &rpcMeter{
		hist: obs.DurationHistogram(obs.Meter(mp, meterName), obs.MetricLibvirtRPCDuration,
			"Duration of each libvirt remote procedure call, from the call sent to its reply (or the connection's loss)."),
		attrs: obs.Clean(attrs),
	}
}

// procName is the name of procedure proc of program, "_OTHER" outside the
// remote program's table.
func procName(program, proc uint32) string {
	if program == remoteProgram && int(proc) < len(procNames) && procNames[proc] != "" {
		return procNames[proc]
	}
	return obs.ErrorTypeOther
}

func (m *rpcMeter) record(method string, d time.Duration, errType string) {
	kv := make([]attribute.KeyValue, 0, len(m.attrs)+2)
	kv = append(kv, m.attrs...)
	kv = append(kv, obs.KeyRPCMethod.String(method))
	if errType != "" {
		kv = append(kv, obs.KeyErrorType.String(errType))
	}
	m.hist.Record(context.Background(), d.Seconds(), metric.WithAttributes(kv...))
}

// rpcCalls are one connection's calls awaiting their reply. The write
// side (go-libvirt's frames and the own calls, serialised by the guard's
// write lock) adds, the reader goroutine removes.
type rpcCalls struct {
	m *rpcMeter

	mu      sync.Mutex
	pending map[int32]pendingCall
	lost    bool
}

type pendingCall struct {
	method string
	start  time.Time
}

// sent notes the packet whose 24-byte header is h, if it is a call.
func (c *rpcCalls) sent(h []byte) {
	if c == nil || binary.BigEndian.Uint32(h[12:16]) != socket.Call {
		return
	}
	serial := int32(binary.BigEndian.Uint32(h[16:20]))
	method := procName(binary.BigEndian.Uint32(h[0:4]), binary.BigEndian.Uint32(h[8:12]))
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lost {
		return
	}
	if c.pending == nil {
		c.pending = map[int32]pendingCall{}
	}
	c.pending[serial] = pendingCall{method: method, start: time.Now()}
}

// replied records the call answered by the reply whose 24-byte header is
// h and whose body is body (read only for an error; nil when it was not
// read). A reply to no call noted (a duplicate) is ignored.
func (c *rpcCalls) replied(h, body []byte) {
	if c == nil {
		return
	}
	serial := int32(binary.BigEndian.Uint32(h[16:20]))
	c.mu.Lock()
	call, ok := c.pending[serial]
	delete(c.pending, serial)
	c.mu.Unlock()
	if !ok {
		return
	}
	errType := ""
	if binary.BigEndian.Uint32(h[20:24]) == socket.StatusError {
		errType = obs.ErrorTypeOther // an error not read, or without a code
		if body != nil {
			if err := decodeRemoteError(body); err != nil {
				errType = obs.ErrorType(libvirterr.Classify(err))
			}
		}
	}
	c.m.record(call.method, time.Since(call.start), errType)
}

// lose records every call still awaiting its reply as failed: the
// connection is gone (a lost link is Transient), and no reply will come.
func (c *rpcCalls) lose() {
	if c == nil {
		return
	}
	c.mu.Lock()
	pending := c.pending
	c.pending, c.lost = nil, true
	c.mu.Unlock()
	for _, call := range pending {
		c.m.record(call.method, time.Since(call.start), errs.Transient.String())
	}
}
