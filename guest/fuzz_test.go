package guest_test

import (
	"net/netip"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/internal/guestconf"
)

// FuzzUserData: any description either fails validation (Permanent, one
// FieldError per problem, never quoting the password) or renders
// user-data that reads back and answers every probing request exactly as
// the description says, without the password in it.
func FuzzUserData(f *testing.F) {
	f.Add(3128, "alice", "s3cret", "10.0.0.0/8", 443, "example.com", false, "10.1.2.3", "api.example.com", 443)
	f.Add(0, "", "", "", 0, "", true, "192.0.2.1", "192.0.2.1", 443)
	f.Add(8080, "bob", "pw", "2001:db8::/32", 8443, "", false, "2001:db8::5", "example.org", 8443)
	f.Add(1, "a:b", "line\nbreak", "10.0.0.1/8", 70000, ".example.com", true, "::1", "x", 1)
	f.Add(65535, "u", "http_access allow all", "0.0.0.0/0", 22, "cache", false, "127.0.0.1", "cache", 22)
	f.Add(3128, "u", "p", "::/0", 443, "Example.COM", false, "::ffff:10.0.0.1", "www.EXAMPLE.com", 443)
	f.Fuzz(func(t *testing.T, port int, name, password, client string, dport int, domain string, open bool, from, host string, tport int) {
		c := guest.Config{Port: port, Open: open}
		if name != "" || password != "" {
			c.Users = []guest.User{{Name: name, Password: password}}
		}
		if client != "" {
			c.AllowedClients = []string{client}
		}
		if dport != 0 || domain != "" {
			d := guest.Destination{}
			if dport != 0 {
				d.Ports = []int{dport}
			}
			if domain != "" {
				d.Domains = []string{domain}
			}
			c.AllowedDestinations = []guest.Destination{d}
		}
		ud, err := guest.UserData(c, &guest.UserDataOptions{Salt: "fuzz"})
		if err != nil {
			if egressproxy.Code(err) != egressproxy.Permanent || len(egressproxy.FieldErrors(err)) == 0 {
				t.Fatalf("invalid description: %v (class %v), want Permanent FieldErrors", err, egressproxy.Code(err))
			}
			// The error says the same for any password that breaks the
			// same rules: it does not depend on the password's content.
			masked := c
			if c.Users != nil {
				masked.Users = []guest.User{{Name: name, Password: mask(password)}}
			}
			if _, merr := guest.UserData(masked, &guest.UserDataOptions{Salt: "fuzz"}); merr == nil || merr.Error() != err.Error() {
				t.Fatalf("the error depends on the password's content: %v, with another password of its shape %v", err, merr)
			}
			for _, fe := range egressproxy.FieldErrors(err) {
				if strings.HasSuffix(fe.Field, ".Password") && fe.Value != "" {
					t.Fatalf("a password FieldError carries its value")
				}
			}
			return
		}
		if len(password) >= 8 {
			other := c
			other.Users = []guest.User{{Name: name, Password: "zz" + password + "zz"}}
			ud2, err := guest.UserData(other, &guest.UserDataOptions{Salt: "fuzz"})
			if err == nil && strings.Contains(ud, password) && !strings.Contains(ud2, password) {
				t.Fatalf("the user-data holds the password")
			}
		}
		g, ok, err := guestconf.Parse(ud)
		if !ok || err != nil {
			t.Fatalf("rendered user-data does not read back: %v, %v\n%s", ok, err, ud)
		}
		addr, err := netip.ParseAddr(from)
		if err != nil {
			addr = netip.MustParseAddr("192.0.2.1")
		}
		rs := []request{
			{client: addr, method: "CONNECT", host: host, port: tport},
			{client: addr, method: "CONNECT", host: host, port: tport, user: name, pass: password},
			{client: addr, method: "CONNECT", host: domain, port: dport, user: name, pass: password},
			{client: addr, method: "GET", host: host, port: tport, user: name, pass: password},
			{client: addr, method: "CONNECT", host: host, port: tport, user: name, pass: password + "x"},
		}
		for _, r := range rs {
			got := g.Decide(guestconf.Request{Client: r.client, Method: r.method, Host: r.host, Port: r.port, Authorization: r.authorization()})
			if want := model(c, r); got != want {
				t.Fatalf("%v: the rendered Squid answers %d, the description %d\n%s", r, got, want, ud)
			}
		}
	})
}

// mask replaces each character of s by one of the same size and kind
// (control or not), and each byte that is no UTF-8 by one byte.
func mask(s string) string {
	var b strings.Builder
	for len(s) > 0 {
		r, n := utf8.DecodeRuneInString(s)
		s = s[n:]
		switch {
		case r < ' ' || r == 0x7f:
			b.WriteByte(1)
		case n <= 1:
			b.WriteByte('x')
		case n == 2:
			b.WriteString("é")
		case n == 3:
			b.WriteString("€")
		default:
			b.WriteString("𝄞")
		}
	}
	return b.String()
}
