package kvm2

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/sshconn"
)

type fakeAnswer struct {
	ifaces []libvirt.DomainInterface
	err    error
	// block makes the call wait for ctx to end and return ctx.Err().
	block bool
	// cancel is called during the call (a caller cancelling mid-flight).
	cancel bool
}

type fakeAddrBackend struct {
	answers map[libvirt.DomainInterfaceAddressesSource]fakeAnswer
	cancel  context.CancelFunc
	mu      sync.Mutex
	calls   []string
}

// asked returns the sources asked, in priority order.
func (f *fakeAddrBackend) asked() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, s := range addressSources {
		if slices.Contains(f.calls, s.name) {
			out = append(out, s.name)
		}
	}
	return strings.Join(out, ",")
}

func (f *fakeAddrBackend) InterfaceAddresses(ctx context.Context, src libvirt.DomainInterfaceAddressesSource) ([]libvirt.DomainInterface, error) {
	name := map[libvirt.DomainInterfaceAddressesSource]string{
		libvirt.DomainInterfaceAddressesSrcAgent: SourceAgent,
		libvirt.DomainInterfaceAddressesSrcLease: SourceLease,
		libvirt.DomainInterfaceAddressesSrcArp:   SourceARP,
	}[src]
	f.mu.Lock()
	f.calls = append(f.calls, name)
	f.mu.Unlock()
	a, ok := f.answers[src]
	if !ok {
		return nil, nil
	}
	if a.cancel && f.cancel != nil {
		f.cancel()
		// what libvirtconn.Session.Do returns when the ctx ends mid-call
		return nil, &sshconn.Error{Kind: sshconn.KindUnreachable, Op: "libvirt call", Err: ctx.Err()}
	}
	if a.block {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return a.ifaces, a.err
}

func iface(mac string, addrs ...string) libvirt.DomainInterface {
	ifc := libvirt.DomainInterface{Name: "eth0"}
	if mac != "" {
		ifc.Hwaddr = libvirt.OptString{mac}
	}
	for _, a := range addrs {
		typ := int32(0)
		if strings.Contains(a, ":") {
			typ = 1
		}
		ifc.Addrs = append(ifc.Addrs, libvirt.DomainIPAddr{Type: typ, Addr: a, Prefix: 24})
	}
	return ifc
}

var (
	errAgentDown = libvirt.Error{Code: uint32(libvirt.ErrAgentUnresponsive), Message: "Guest agent is not responding: QEMU guest agent is not connected"}
	errNoARP     = libvirt.Error{Code: uint32(libvirt.ErrInternalError), Message: "wrong nlmsg len"}
	errNoLease   = libvirt.Error{Code: uint32(libvirt.ErrOperationInvalid), Message: "no network for interface"}
	errNoSupport = libvirt.Error{Code: uint32(libvirt.ErrArgumentUnsupported), Message: "unsupported source"}
	errLinkDead  = &sshconn.Error{Kind: sshconn.KindUnreachable, Op: "libvirt call", Err: libvirt.Error{Code: uint32(libvirt.ErrInvalidArg), Message: "invalid argument"}}
)

const (
	agentSrc = libvirt.DomainInterfaceAddressesSrcAgent
	leaseSrc = libvirt.DomainInterfaceAddressesSrcLease
	arpSrc   = libvirt.DomainInterfaceAddressesSrcArp
)

func TestDiscoverAddress(t *testing.T) {
	t.Parallel()
	const mac = "52:54:00:aa:bb:cc"
	tests := []struct {
		name      string
		answers   map[libvirt.DomainInterfaceAddressesSource]fakeAnswer
		preCancel bool
		deadline  time.Duration
		wantIP    string
		wantSrc   string
		wantCode  errs.ErrorCode
		wantCalls string            // the sources whose answer decides (all are asked)
		wantState egressproxy.State // for a running domain, when no error
		wantMsg   []string          // substrings of the error
	}{
		{
			name:    "agent ok",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {ifaces: []libvirt.DomainInterface{iface("00:00:00:00:00:00", "127.0.0.1", "::1"), iface(mac, "192.168.122.10", "fe80::1")}}},
			wantIP:  "192.168.122.10", wantSrc: SourceAgent, wantCalls: "agent", wantState: egressproxy.StateRunning,
		},
		{
			name: "agent error, lease ok",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {ifaces: []libvirt.DomainInterface{iface(mac, "192.168.122.11")}},
			},
			wantIP: "192.168.122.11", wantSrc: SourceLease, wantCalls: "agent,lease", wantState: egressproxy.StateRunning,
		},
		{
			name: "agent and lease error, arp ok",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {err: errNoLease},
				arpSrc:   {ifaces: []libvirt.DomainInterface{iface(mac, "10.0.0.7")}},
			},
			wantIP: "10.0.0.7", wantSrc: SourceARP, wantCalls: "agent,lease,arp", wantState: egressproxy.StateRunning,
		},
		{
			name: "agent only loopback, lease ok",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {ifaces: []libvirt.DomainInterface{iface("", "127.0.0.1")}},
				leaseSrc: {ifaces: []libvirt.DomainInterface{iface(mac, "192.168.122.12")}},
			},
			wantIP: "192.168.122.12", wantSrc: SourceLease, wantCalls: "agent,lease", wantState: egressproxy.StateRunning,
		},
		{
			name:    "ipv6 only",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {ifaces: []libvirt.DomainInterface{iface(mac, "fe80::2", "2001:db8::5")}}},
			wantIP:  "2001:db8::5", wantSrc: SourceAgent, wantCalls: "agent", wantState: egressproxy.StateRunning,
		},
		{
			name: "booting: agent error, lease empty, arp error → no address yet",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {ifaces: nil},
				arpSrc:   {err: errNoARP},
			},
			wantCalls: "agent,lease,arp", wantState: egressproxy.StateProvisioning,
		},
		{
			name: "all error → transient naming each source",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {err: errNoLease},
				arpSrc:   {err: errNoARP},
			},
			wantCode: errs.Transient, wantCalls: "agent,lease,arp",
			wantMsg: []string{"every source failed", "agent: Guest agent is not responding", "lease: no network for interface", "arp: wrong nlmsg len"},
		},
		{
			name: "all error with permanent-looking codes stays transient",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errNoSupport},
				leaseSrc: {err: errNoLease},
				arpSrc:   {err: errNoSupport},
			},
			wantCode: errs.Transient, wantCalls: "agent,lease,arp",
		},
		{
			name:     "link dead",
			answers:  map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {err: errLinkDead}},
			wantCode: errs.Transient, wantCalls: "agent",
			wantMsg: []string{"link to libvirt died", "agent:"},
		},
		{
			name: "link dies on the second source (go-libvirt EINVAL)",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {err: syscall.EINVAL},
			},
			wantCode: errs.Transient, wantCalls: "agent,lease",
			wantMsg: []string{"link to libvirt died", "agent: Guest agent", "lease: invalid argument"},
		},
		{
			name:      "ctx cancelled before",
			preCancel: true,
			wantCode:  errs.Canceled, wantCalls: "",
		},
		{
			name:     "ctx cancelled during the agent call",
			answers:  map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {cancel: true}},
			wantCode: errs.Canceled, wantCalls: "agent",
		},
		{
			name: "ctx deadline during the lease call",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {block: true},
			},
			deadline: 20 * time.Millisecond,
			wantCode: errs.DeadlineExceeded, wantCalls: "agent,lease",
		},
		{
			name:     "domain vanished",
			answers:  map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {err: libvirt.Error{Code: uint32(libvirt.ErrNoDomain), Message: "Domain not found"}}},
			wantCode: errs.NotFound, wantCalls: "agent",
		},
		{
			name:     "provider closed",
			answers:  map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {err: &sshconn.Error{Kind: sshconn.KindClosed, Op: "do"}}},
			wantCode: errs.Permanent, wantCalls: "agent",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tt.deadline > 0 {
				ctx, cancel = context.WithTimeout(ctx, tt.deadline)
				defer cancel()
			}
			if tt.preCancel {
				cancel()
			}
			b := &fakeAddrBackend{answers: tt.answers, cancel: cancel}
			ip, src, err := discoverAddress(ctx, b, mac)
			// Every source is asked at once; the answers are judged in
			// priority order (wantCalls: up to the deciding one).
			want := "agent,lease,arp"
			if tt.preCancel {
				want = ""
			}
			if got := b.asked(); got != want {
				t.Errorf("sources asked = %q, want %q", got, want)
			}
			if c := errs.Code(err); c != tt.wantCode {
				t.Fatalf("error %v: code %v, want %v", err, c, tt.wantCode)
			}
			for _, m := range tt.wantMsg {
				if err == nil || !strings.Contains(err.Error(), m) {
					t.Errorf("error %v does not say %q", err, m)
				}
			}
			if err != nil {
				if ip != "" || src != "" {
					t.Errorf("address %q/%q returned with an error", ip, src)
				}
				if tt.wantCode == errs.Transient && strings.Contains(err.Error(), "no address") {
					t.Errorf("a failure was reported as 'no address yet': %v", err)
				}
				return
			}
			if ip != tt.wantIP || src != tt.wantSrc {
				t.Errorf("address = %q from %q, want %q from %q", ip, src, tt.wantIP, tt.wantSrc)
			}
			if st := mapState(libvirt.DomainRunning, ip != ""); st != tt.wantState {
				t.Errorf("state = %s, want %s", st, tt.wantState)
			}
		})
	}
}

func TestAddressErrorUnwrap(t *testing.T) {
	t.Parallel()
	b := &fakeAddrBackend{answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
		agentSrc: {err: errAgentDown}, leaseSrc: {err: errNoLease}, arpSrc: {err: errNoARP},
	}}
	_, _, err := discoverAddress(context.Background(), b, "")
	var ae *AddressError
	if !errors.As(err, &ae) || len(ae.Sources) != 3 || ae.LinkDead {
		t.Fatalf("err = %#v", err)
	}
	if !errors.Is(err, errNoARP) {
		t.Error("the ARP cause is not reachable with errors.Is")
	}
	if !errors.Is(err, errs.ErrTransient) {
		t.Error("not transient")
	}
}

// orderedBackend answers the sources in a chosen order, each only once the
// sources before it in that order have answered, so it proves that
// discoverAddress asks them all at once (asked one after the other, the
// first source would wait for one never asked, and fail after a while).
type orderedBackend struct {
	order   []libvirt.DomainInterfaceAddressesSource // the order of the answers
	answers map[libvirt.DomainInterfaceAddressesSource]fakeAnswer
	done    map[libvirt.DomainInterfaceAddressesSource]chan struct{}
	ended   map[libvirt.DomainInterfaceAddressesSource]chan struct{} // closed when the call returned
}

func newOrderedBackend(answers map[libvirt.DomainInterfaceAddressesSource]fakeAnswer, order ...libvirt.DomainInterfaceAddressesSource) *orderedBackend {
	b := &orderedBackend{order: order, answers: answers,
		done:  map[libvirt.DomainInterfaceAddressesSource]chan struct{}{},
		ended: map[libvirt.DomainInterfaceAddressesSource]chan struct{}{}}
	for _, s := range addressSources {
		b.done[s.src], b.ended[s.src] = make(chan struct{}), make(chan struct{})
	}
	return b
}

func (b *orderedBackend) InterfaceAddresses(ctx context.Context, src libvirt.DomainInterfaceAddressesSource) ([]libvirt.DomainInterface, error) {
	defer close(b.ended[src])
	i := slices.Index(b.order, src)
	if i > 0 {
		t := time.NewTimer(5 * time.Second)
		defer t.Stop()
		select {
		case <-b.done[b.order[i-1]]:
		case <-t.C:
			return nil, errors.New("the source answering before this one was never asked (sources asked one after the other?)")
		}
	}
	a := b.answers[src]
	if a.block {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	close(b.done[src])
	return a.ifaces, a.err
}

// TestDiscoverAddressConcurrent: the sources are asked at once, the answer
// is still chosen by priority whatever order the answers arrive in, and a
// decision does not wait for lower-priority sources (they are cancelled,
// and have returned when discoverAddress returns).
func TestDiscoverAddressConcurrent(t *testing.T) {
	t.Parallel()
	const mac = "52:54:00:aa:bb:cc"
	ok := func(ip string) fakeAnswer { return fakeAnswer{ifaces: []libvirt.DomainInterface{iface(mac, ip)}} }
	for _, tc := range []struct {
		name    string
		answers map[libvirt.DomainInterfaceAddressesSource]fakeAnswer
		order   []libvirt.DomainInterfaceAddressesSource
		wantIP  string
		wantSrc string
	}{
		{"arp first, agent last: the agent's answer wins",
			map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: ok("192.0.2.1"), leaseSrc: ok("192.0.2.2"), arpSrc: ok("192.0.2.3")},
			[]libvirt.DomainInterfaceAddressesSource{arpSrc, leaseSrc, agentSrc}, "192.0.2.1", SourceAgent},
		{"agent fails last: the lease's answer wins over ARP's",
			map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {err: errAgentDown}, leaseSrc: ok("192.0.2.2"), arpSrc: ok("192.0.2.3")},
			[]libvirt.DomainInterfaceAddressesSource{arpSrc, leaseSrc, agentSrc}, "192.0.2.2", SourceLease},
		{"agent empty, lease fails: ARP",
			map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {}, leaseSrc: {err: errNoLease}, arpSrc: ok("192.0.2.3")},
			[]libvirt.DomainInterfaceAddressesSource{leaseSrc, arpSrc, agentSrc}, "192.0.2.3", SourceARP},
		{"agent answers while lease and ARP hang: decided at once",
			map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: ok("192.0.2.1"), leaseSrc: {block: true}, arpSrc: {block: true}},
			[]libvirt.DomainInterfaceAddressesSource{agentSrc}, "192.0.2.1", SourceAgent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newOrderedBackend(tc.answers, tc.order...)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ip, src, err := discoverAddress(ctx, b, mac)
			if err != nil || ip != tc.wantIP || src != tc.wantSrc {
				t.Errorf("= %q, %q, %v; want %q from %q", ip, src, err, tc.wantIP, tc.wantSrc)
			}
			for _, s := range addressSources {
				select {
				case <-b.ended[s.src]:
				default:
					t.Errorf("the %s call still runs after discoverAddress returned", s.name)
				}
			}
		})
	}
}
