package guest_test

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"pgregory.net/rapid"

	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/internal/guestconf"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
)

// request is one request to decide, as a client makes it.
type request struct {
	client     netip.Addr
	method     string
	host       string
	port       int
	user, pass string
	header     string // sent as is when set (a malformed one)
}

func (r request) String() string {
	return fmt.Sprintf("%s %s:%d from %s, user %q header %q", r.method, r.host, r.port, r.client, r.user, r.header)
}

func (r request) authorization() string {
	switch {
	case r.header != "":
		return r.header
	case r.user == "":
		return ""
	}
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(r.user+":"+r.pass))
}

// model is what c describes, written from the description alone: 403 for
// anything but CONNECT and for clients outside AllowedClients, then 407
// without a user's credentials, then 200 when a destination allows the
// target (no Domains: any host; Domains: a name equal to one or under
// it), else 403.
func model(c guest.Config, r request) int {
	if r.method != http.MethodConnect {
		return http.StatusForbidden
	}
	if len(c.AllowedClients) > 0 {
		in := false
		for _, s := range c.AllowedClients {
			p, err := netip.ParsePrefix(s)
			if err != nil {
				a := netip.MustParseAddr(s)
				p = netip.PrefixFrom(a, a.BitLen())
			}
			in = in || p.Contains(r.client.Unmap())
		}
		if !in {
			return http.StatusForbidden
		}
	}
	if len(c.Users) > 0 {
		ok := r.header == "" && slices.ContainsFunc(c.Users, func(u guest.User) bool { return u.Name == r.user && u.Password == r.pass })
		if !ok {
			return http.StatusProxyAuthRequired
		}
	}
	dests := c.AllowedDestinations
	if len(dests) == 0 {
		dests = []guest.Destination{{}}
	}
	_, isAddr := netip.ParseAddr(r.host)
	host := strings.ToLower(r.host)
	for _, d := range dests {
		ports := d.Ports
		if len(ports) == 0 {
			ports = []int{443}
		}
		if !slices.Contains(ports, r.port) {
			continue
		}
		if len(d.Domains) == 0 {
			return http.StatusOK
		}
		for _, dom := range d.Domains {
			dom = strings.ToLower(dom)
			if isAddr != nil && (host == dom || strings.HasSuffix(host, "."+dom)) {
				return http.StatusOK
			}
		}
	}
	return http.StatusForbidden
}

var (
	clientPool = []string{"10.0.0.0/8", "10.1.0.0/16", "192.168.1.0/24", "192.0.2.7", "2001:db8::/32", "::1", "127.0.0.0/8", "172.16.0.0/12"}
	addrPool   = []string{"10.1.2.3", "10.200.0.1", "192.168.1.5", "192.168.2.5", "192.0.2.7", "192.0.2.8", "2001:db8::1", "2001:db9::1", "::1", "127.0.0.1", "::ffff:10.1.2.3", "172.31.255.255"}
	portPool   = []int{443, 80, 8080, 8443, 22, 3128, 65535, 1}
	domainPool = []string{"example.com", "api.example.com", "example.org", "test", "Example.NET", "a-b.example.com"}
	hostPool   = []string{"example.com", "api.example.com", "x.api.example.com", "badexample.com", "example.org", "test", "EXAMPLE.COM", "example.net",
		"a-b.example.com", "192.0.2.1", "::1", "10.1.2.3", "example.com.evil", "com", ""}
	namePool = []string{"alice", "bob", "carol.d", "x@y", "u+1"}
)

// genConfig draws a valid Config (TLS from pair when drawn).
func genConfig(t *rapid.T, pair guesttest.TLSPair) guest.Config {
	var c guest.Config
	c.Port = rapid.SampledFrom([]int{0, 3128, 8080, 1, 65535}).Draw(t, "port")
	for _, n := range rapid.SliceOfNDistinct(rapid.SampledFrom(namePool), 0, 3, rapid.ID).Draw(t, "users") {
		c.Users = append(c.Users, guest.User{Name: n, Password: rapid.StringMatching(`[ -~]{1,20}`).Draw(t, "password")})
	}
	c.AllowedClients = rapid.SliceOfN(rapid.SampledFrom(clientPool), 0, 4).Draw(t, "clients")
	c.Open = len(c.Users) == 0 && len(c.AllowedClients) == 0
	for range rapid.IntRange(0, 3).Draw(t, "destinations") {
		c.AllowedDestinations = append(c.AllowedDestinations, guest.Destination{
			Ports:   rapid.SliceOfN(rapid.SampledFrom(portPool), 0, 3).Draw(t, "ports"),
			Domains: rapid.SliceOfN(rapid.SampledFrom(domainPool), 0, 3).Draw(t, "domains"),
		})
	}
	if rapid.Bool().Draw(t, "tls") {
		c.TLS = &guest.TLS{Certificate: pair.CertPEM, Key: pair.KeyPEM}
	}
	return c
}

func genRequest(t *rapid.T, c guest.Config) request {
	r := request{
		client: netip.MustParseAddr(rapid.SampledFrom(addrPool).Draw(t, "client")),
		method: rapid.SampledFrom([]string{"CONNECT", "CONNECT", "CONNECT", "GET"}).Draw(t, "method"),
		host:   rapid.SampledFrom(hostPool).Draw(t, "host"),
		port:   rapid.SampledFrom(portPool).Draw(t, "targetPort"),
	}
	switch rapid.IntRange(0, 4).Draw(t, "auth") {
	case 1, 2: // a user's own credentials
		if len(c.Users) > 0 {
			u := rapid.SampledFrom(c.Users).Draw(t, "user")
			r.user, r.pass = u.Name, u.Password
		}
	case 3: // a known name, a wrong password
		r.user, r.pass = rapid.SampledFrom(namePool).Draw(t, "name"), "wrong"
	case 4:
		r.header = rapid.SampledFrom([]string{"Basic !!!", "Bearer x", "Basic " + base64.StdEncoding.EncodeToString([]byte("no-colon"))}).Draw(t, "header")
	}
	return r
}

// The rendered configuration, read back and decided by Squid's rules,
// allows exactly what the description allows: never more (a stranger, a
// port, a domain, a method let through), never less.
func TestPropertyRenderedAllowsWhatIsDescribed(t *testing.T) {
	pair := guesttest.NewTLS(t)
	rapid.Check(t, func(t *rapid.T) {
		c := genConfig(t, pair)
		ud, err := guest.UserData(c, &guest.UserDataOptions{Salt: "seed"})
		if err != nil {
			t.Fatalf("UserData(%v): %v", c, err)
		}
		g, _, err := guestconf.Parse(ud)
		if err != nil {
			t.Fatal(err)
		}
		if want := c.Port; g.Port != want && !(want == 0 && g.Port == 3128) {
			t.Fatalf("port %d, want %d", g.Port, want)
		}
		if (g.Certificate != nil) != (c.TLS != nil) {
			t.Fatalf("TLS served %v, described %v", g.Certificate != nil, c.TLS != nil)
		}
		for i := range 20 {
			r := genRequest(t, c)
			if got, want := g.Decide(guestconf.Request{Client: r.client, Method: r.method, Host: r.host, Port: r.port, Authorization: r.authorization()}), model(c, r); got != want {
				t.Fatalf("request %d %v: the rendered Squid answers %d, the description %d\n%s", i, r, got, want, ud)
			}
		}
	})
}

// Squid itself accepts every rendered configuration, without a warning:
// a sample of the property's configurations and the corner cases.
func TestSquidAcceptsRendered(t *testing.T) {
	squid := guesttest.Squid(t)
	pair := guesttest.NewTLS(t)
	many := make([]string, 40)
	for i := range many {
		many[i] = fmt.Sprintf("d%d.example.com", i)
	}
	fixed := []guest.Config{
		{Open: true},
		{Users: users(), AllowedClients: []string{"10.0.0.0/8", "10.1.0.0/16", "::1", "2001:db8::/32"}, Port: 8080},
		{AllowedClients: []string{"192.0.2.7"}, AllowedDestinations: []guest.Destination{{Ports: []int{443, 443, 80}, Domains: []string{"example.com", "api.example.com", "EXAMPLE.com"}}, {Ports: []int{80}}, {Domains: many}}},
		{Users: users(), TLS: &guest.TLS{Certificate: pair.CertPEM, Key: pair.KeyPEM}},
	}
	for i, c := range fixed {
		ud, err := guest.UserData(c, nil)
		if err != nil {
			t.Fatalf("fixed %d: %v", i, err)
		}
		guesttest.SquidParse(t, squid, ud)
	}
	rapid.Check(t, func(rt *rapid.T) {
		ud, err := guest.UserData(genConfig(rt, pair), nil)
		if err != nil {
			rt.Fatal(err)
		}
		guesttest.SquidParse(t, squid, ud)
	})
}
