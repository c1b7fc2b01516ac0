package guesttest

import (
	"context"
	"net"
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/health"
)

// The names and the port of the destination Guard allows by domain only.
// Nothing resolves them in the test networks: a CONNECT the rules let
// through fails at the proxy's lookup or dial, not at its rules.
const (
	AllowedDomain = "allowed.egressproxy.test"
	DeniedDomain  = "denied.egressproxy.test"
	DomainPort    = 8443
)

// Guard is the table of cases that shows a proxy closed to strangers and
// its egress address observed: it describes the proxy (Config) and probes
// it (Run). The same table runs against memprovider's served proxies and
// against the booting guest, so both give the same answers.
type Guard struct {
	User, Password string
	// TLS is the proxy's certificate; probes trust its CA.
	TLS TLSPair
	// Clients are the allowed client ranges: the probes' own source must
	// be in them.
	Clients []string
	// Target is an allowed destination; the tunnel proof reads its token.
	Target *Target
	// Echo is the "what is my address" server; its port is allowed.
	Echo *Echo
	// AlsoAllow are more destinations (host:port) whose ports are allowed.
	AlsoAllow []string
}

// NewGuard returns a Guard with a fresh user, password and certificate.
func NewGuard(t testing.TB, clients []string, target *Target, echo *Echo) *Guard {
	t.Helper()
	return &Guard{User: "probe", Password: "pw-" + RandHex(t, 8), TLS: NewTLS(t), Clients: clients, Target: target, Echo: echo}
}

// Config is the description of the proxy under test on port: the user,
// the client ranges, TLS, and as destinations the ports of Target and
// Echo on any host and DomainPort on AllowedDomain only.
func (g *Guard) Config(port int) guest.Config {
	ports := []int{portOf(g.Target.Addr), portOf(g.Echo.Addr)}
	for _, a := range g.AlsoAllow {
		ports = append(ports, portOf(a))
	}
	return guest.Config{
		Port:           port,
		Users:          []guest.User{{Name: g.User, Password: g.Password}},
		AllowedClients: g.Clients,
		AllowedDestinations: []guest.Destination{
			{Ports: ports},
			{Ports: []int{DomainPort}, Domains: []string{AllowedDomain}},
		},
		TLS: &guest.TLS{Certificate: g.TLS.CertPEM, Key: g.TLS.KeyPEM},
	}
}

func portOf(hostport string) int {
	_, p, _ := net.SplitHostPort(hostport)
	n, _ := strconv.Atoi(p)
	return n
}

// GuardSite is the proxy under test and how to reach it.
type GuardSite struct {
	// Proxy is its address (host:port).
	Proxy string
	// Egress is the address its traffic leaves from: what Target and Echo
	// must see.
	Egress string
	// Outsider dials the proxy from an address outside the allowed
	// client ranges. Nil: that case is skipped, saying why (OutsiderWhy).
	Outsider    func(ctx context.Context, network, address string) (net.Conn, error)
	OutsiderWhy string
}

type guardCase struct {
	name   string
	target string
	// edit changes the probe's options from the allowed baseline (the
	// user's credentials, TLS trusting the CA).
	edit func(o *health.ProbeOptions)
	// want is the kind (unless anyKind); status, when not 0, the proxy's
	// status; not lists statuses that must not be the answer.
	want    health.Kind
	anyKind bool
	status  int
	not     []int
	// kinds, when set, are the kinds accepted instead of want.
	kinds []health.Kind
	// timeout bounds the probe (zero: 20s).
	timeout time.Duration
	check   func(t *testing.T, r health.Result)
}

// Run probes the proxy with every case, each a subtest, and checks each
// answer's kind (and status).
func (g *Guard) Run(t *testing.T, ctx context.Context, s GuardSite) {
	t.Helper()
	other := NewTLS(t)
	targetHost, _, _ := net.SplitHostPort(g.Target.Addr)
	cases := []guardCase{
		{name: "allowed destination", target: g.Target.Addr, want: health.KindNone, status: http.StatusOK,
			edit: func(o *health.ProbeOptions) { o.Exchange = health.HTTPGet(g.Target.Addr, g.Target.Token) },
			check: func(t *testing.T, r health.Result) {
				if peers := g.Target.Seen(); len(peers) == 0 || peers[len(peers)-1] != s.Egress {
					t.Errorf("the target saw %v, want the last request from %s", peers, s.Egress)
				}
			}},
		{name: "egress address", target: g.Target.Addr, want: health.KindNone, status: http.StatusOK,
			edit: func(o *health.ProbeOptions) { o.EgressURL = g.Echo.URL },
			check: func(t *testing.T, r health.Result) {
				peers := g.Echo.Seen()
				if r.EgressErr != nil || r.EgressAddress.String() != s.Egress || len(peers) == 0 || peers[len(peers)-1] != s.Egress {
					t.Errorf("egress address %v (err %v); the echo server saw %v; want %s from both", r.EgressAddress, r.EgressErr, peers, s.Egress)
				}
			}},
		{name: "no credentials", target: g.Target.Addr, want: health.KindAuthRequired, status: http.StatusProxyAuthRequired,
			edit: func(o *health.ProbeOptions) { o.Username, o.Password = "", "" }},
		{name: "wrong password", target: g.Target.Addr, want: health.KindAuthRequired, status: http.StatusProxyAuthRequired,
			edit: func(o *health.ProbeOptions) { o.Password = "not-" + g.Password }},
		{name: "unknown user", target: g.Target.Addr, want: health.KindAuthRequired, status: http.StatusProxyAuthRequired,
			edit: func(o *health.ProbeOptions) { o.Username = "someone-else" }},
		{name: "port not allowed", target: net.JoinHostPort(targetHost, "443"), want: health.KindProxyStatus, status: http.StatusForbidden},
		{name: "domain not allowed", target: net.JoinHostPort(DeniedDomain, strconv.Itoa(DomainPort)), want: health.KindProxyStatus, status: http.StatusForbidden},
		// The rules let it through, and the proxy's lookup of the name
		// fails: an error status, or, where no DNS server answers (the
		// lab's guest), a lookup that outlasts the probe. A refusal by
		// the rules would be a 403 at once.
		{name: "domain allowed, then unreachable", target: net.JoinHostPort(AllowedDomain, strconv.Itoa(DomainPort)),
			kinds: []health.Kind{health.KindProxyStatus, health.KindTimeout}, timeout: 5 * time.Second,
			not: []int{http.StatusForbidden, http.StatusProxyAuthRequired}},
		{name: "TLS with another CA", target: g.Target.Addr, want: health.KindTLS,
			edit: func(o *health.ProbeOptions) { o.ProxyTLS = other.ClientConfig() }},
		{name: "plain HTTP to the TLS port", target: g.Target.Addr, anyKind: true,
			edit: func(o *health.ProbeOptions) { o.ProxyTLS = nil },
			check: func(t *testing.T, r health.Result) {
				if r.OK || r.StatusCode != 0 {
					t.Errorf("a plain CONNECT to the TLS port: ok %v, status %d; want no HTTP answer", r.OK, r.StatusCode)
				}
			}},
		{name: "client outside the allowed ranges", target: g.Target.Addr, want: health.KindProxyStatus, status: http.StatusForbidden,
			edit: func(o *health.ProbeOptions) { o.DialContext = s.Outsider }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.name == "client outside the allowed ranges" && s.Outsider == nil {
				t.Skipf("no source outside the allowed ranges: %s", s.OutsiderWhy)
			}
			o := health.ProbeOptions{Timeout: 20 * time.Second, Username: g.User, Password: g.Password, ProxyTLS: g.TLS.ClientConfig()}
			if c.timeout != 0 {
				o.Timeout = c.timeout
			}
			if c.edit != nil {
				c.edit(&o)
			}
			r := health.Probe(ctx, s.Proxy, c.target, &o)
			t.Logf("CONNECT %s via %s: ok %v, kind %v, status %d, %s (err %v)", c.target, s.Proxy, r.OK, r.Kind, r.StatusCode, r.Total.Round(time.Millisecond), r.Err)
			c.verify(t, r)
			if c.check != nil {
				c.check(t, r)
			}
		})
	}
}

// verify checks a case's answer: its kind (one of kinds, or want and
// status unless anyKind) and that its status is none of not.
func (c guardCase) verify(t *testing.T, r health.Result) {
	t.Helper()
	switch {
	case len(c.kinds) > 0:
		if r.OK || !slices.Contains(c.kinds, r.Kind) {
			t.Errorf("ok %v kind %v, want one of %v", r.OK, r.Kind, c.kinds)
		}
	case !c.anyKind && (r.Kind != c.want || (c.status != 0 && r.StatusCode != c.status)):
		t.Errorf("kind %v status %d, want kind %v status %d", r.Kind, r.StatusCode, c.want, c.status)
	}
	for _, bad := range c.not {
		if r.StatusCode == bad {
			t.Errorf("status %d: the rules refused it", bad)
		}
	}
}
