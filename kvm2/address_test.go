package kvm2

import (
	"context"
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/provider"
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
	calls   []string
}

func (f *fakeAddrBackend) InterfaceAddresses(ctx context.Context, src libvirt.DomainInterfaceAddressesSource) ([]libvirt.DomainInterface, error) {
	name := map[libvirt.DomainInterfaceAddressesSource]string{
		libvirt.DomainInterfaceAddressesSrcAgent: SourceAgent,
		libvirt.DomainInterfaceAddressesSrcLease: SourceLease,
		libvirt.DomainInterfaceAddressesSrcArp:   SourceARP,
	}[src]
	f.calls = append(f.calls, name)
	a, ok := f.answers[src]
	if !ok {
		return nil, nil
	}
	if a.cancel && f.cancel != nil {
		f.cancel()
		// what sshconn.Libvirt.Do returns when the ctx ends mid-call
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
		wantCode  provider.ErrorCode
		wantCalls string
		wantState provider.State // for a running domain, when no error
		wantMsg   []string       // substrings of the error
	}{
		{
			name:    "agent ok",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {ifaces: []libvirt.DomainInterface{iface("00:00:00:00:00:00", "127.0.0.1", "::1"), iface(mac, "192.168.122.10", "fe80::1")}}},
			wantIP:  "192.168.122.10", wantSrc: SourceAgent, wantCalls: "agent", wantState: provider.StateRunning,
		},
		{
			name: "agent error, lease ok",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {ifaces: []libvirt.DomainInterface{iface(mac, "192.168.122.11")}},
			},
			wantIP: "192.168.122.11", wantSrc: SourceLease, wantCalls: "agent,lease", wantState: provider.StateRunning,
		},
		{
			name: "agent and lease error, arp ok",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {err: errNoLease},
				arpSrc:   {ifaces: []libvirt.DomainInterface{iface(mac, "10.0.0.7")}},
			},
			wantIP: "10.0.0.7", wantSrc: SourceARP, wantCalls: "agent,lease,arp", wantState: provider.StateRunning,
		},
		{
			name: "agent only loopback, lease ok",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {ifaces: []libvirt.DomainInterface{iface("", "127.0.0.1")}},
				leaseSrc: {ifaces: []libvirt.DomainInterface{iface(mac, "192.168.122.12")}},
			},
			wantIP: "192.168.122.12", wantSrc: SourceLease, wantCalls: "agent,lease", wantState: provider.StateRunning,
		},
		{
			name:    "ipv6 only",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {ifaces: []libvirt.DomainInterface{iface(mac, "fe80::2", "2001:db8::5")}}},
			wantIP:  "2001:db8::5", wantSrc: SourceAgent, wantCalls: "agent", wantState: provider.StateRunning,
		},
		{
			name: "booting: agent error, lease empty, arp error → no address yet",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {ifaces: nil},
				arpSrc:   {err: errNoARP},
			},
			wantCalls: "agent,lease,arp", wantState: provider.StateProvisioning,
		},
		{
			name: "all error → transient naming each source",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {err: errNoLease},
				arpSrc:   {err: errNoARP},
			},
			wantCode: provider.Transient, wantCalls: "agent,lease,arp",
			wantMsg: []string{"every source failed", "agent: Guest agent is not responding", "lease: no network for interface", "arp: wrong nlmsg len"},
		},
		{
			name: "all error with permanent-looking codes stays transient",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errNoSupport},
				leaseSrc: {err: errNoLease},
				arpSrc:   {err: errNoSupport},
			},
			wantCode: provider.Transient, wantCalls: "agent,lease,arp",
		},
		{
			name:     "link dead",
			answers:  map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {err: errLinkDead}},
			wantCode: provider.Transient, wantCalls: "agent",
			wantMsg: []string{"link to libvirt died", "agent:"},
		},
		{
			name: "link dies on the second source (go-libvirt EINVAL)",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {err: syscall.EINVAL},
			},
			wantCode: provider.Transient, wantCalls: "agent,lease",
			wantMsg: []string{"link to libvirt died", "agent: Guest agent", "lease: invalid argument"},
		},
		{
			name:      "ctx cancelled before",
			preCancel: true,
			wantCode:  provider.Canceled, wantCalls: "",
		},
		{
			name:     "ctx cancelled during the agent call",
			answers:  map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {cancel: true}},
			wantCode: provider.Canceled, wantCalls: "agent",
		},
		{
			name: "ctx deadline during the lease call",
			answers: map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{
				agentSrc: {err: errAgentDown},
				leaseSrc: {block: true},
			},
			deadline: 20 * time.Millisecond,
			wantCode: provider.DeadlineExceeded, wantCalls: "agent,lease",
		},
		{
			name:     "domain vanished",
			answers:  map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {err: libvirt.Error{Code: uint32(libvirt.ErrNoDomain), Message: "Domain not found"}}},
			wantCode: provider.NotFound, wantCalls: "agent",
		},
		{
			name:     "provider closed",
			answers:  map[libvirt.DomainInterfaceAddressesSource]fakeAnswer{agentSrc: {err: &sshconn.Error{Kind: sshconn.KindClosed, Op: "do"}}},
			wantCode: provider.Permanent, wantCalls: "agent",
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
			if got := strings.Join(b.calls, ","); got != tt.wantCalls {
				t.Errorf("sources asked = %q, want %q", got, tt.wantCalls)
			}
			if c := provider.Code(err); c != tt.wantCode {
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
				if tt.wantCode == provider.Transient && strings.Contains(err.Error(), "no address") {
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
	if !errors.Is(err, provider.ErrTransient) {
		t.Error("not transient")
	}
}
