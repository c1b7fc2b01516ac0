package guestconf

import (
	"net/netip"
	"strings"
	"testing"
)

// FuzzParse: memprovider reads any user-data an embedder gives it. Parse
// never panics, refuses what is not the contract, and what it reads can
// be decided without a panic; an error never quotes the user-data.
func FuzzParse(f *testing.F) {
	p := Policy{Port: 3128, Users: []User{{Name: "u", Hash: "$6$salt$hash"}}, Clients: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
		Rules: []Rule{{Ports: []int{443}, Domains: []string{"example.com"}}, {Ports: []int{80}}}}
	ud, err := UserData(p)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(ud)
	f.Add(strings.Replace(ud, "deny all", "allow all", 1))
	f.Add("#cloud-config\n" + Marker + "\nwrite_files: []\n")
	f.Add("#cloud-config\nwrite_files: []\n")
	f.Add("")
	f.Fuzz(func(t *testing.T, ud string) {
		c, ok, err := Parse(ud)
		if !ok || err != nil {
			if err != nil && len(ud) > 40 && strings.Contains(err.Error(), ud) {
				t.Fatalf("the error quotes the user-data")
			}
			return
		}
		for _, r := range []Request{
			{Client: netip.MustParseAddr("10.1.2.3"), Method: "CONNECT", Host: "example.com", Port: 443, Authorization: "Basic dTpw"},
			{Client: netip.MustParseAddr("::1"), Method: "GET", Host: "192.0.2.1", Port: 80},
			{},
		} {
			switch code := c.Decide(r); code {
			case 200, 403, 407:
			default:
				t.Fatalf("Decide answered %d", code)
			}
		}
	})
}
