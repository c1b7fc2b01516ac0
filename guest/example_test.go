package guest_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/memprovider"
)

// A proxy for one team: its own office range, credentials, and HTTPS to
// two domains only. The Squid configuration UserData writes says exactly
// that.
func ExampleUserData() {
	cfg := guest.Config{
		Port:           3128,
		Users:          []guest.User{{Name: "team-a", Password: "example-only"}},
		AllowedClients: []string{"198.51.100.0/24"},
		AllowedDestinations: []guest.Destination{
			{Domains: []string{"api.example.com", "example.org"}}, // port 443
		},
	}
	ud, err := guest.UserData(cfg, &guest.UserDataOptions{Salt: "uid-of-the-instance"})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, line := range strings.Split(ud, "\n") {
		if l := strings.TrimSpace(line); strings.HasPrefix(l, "http_access") || strings.HasPrefix(l, "acl") {
			fmt.Println(l)
		}
	}
	fmt.Println(strings.Contains(ud, "example-only"))
	// Output:
	// acl egp_connect method CONNECT
	// acl egp_clients src 198.51.100.0/24
	// acl egp_users proxy_auth REQUIRED
	// acl egp_dest1_ports port 443
	// acl egp_dest1_domains dstdomain -n .api.example.com .example.org
	// http_access deny !egp_connect
	// http_access deny !egp_clients
	// http_access deny !egp_users
	// http_access allow egp_dest1_ports egp_dest1_domains
	// http_access deny all
	// false
}

// Closed by default: a description with neither users nor client ranges
// is refused unless it says it is open.
func ExampleConfig_Validate() {
	fmt.Println(guest.Config{}.Validate())
	fmt.Println(guest.Config{Open: true}.Validate())
	// Output:
	// invalid Users: is empty and so is AllowedClients: set one of them, or set Open to true to serve anyone who reaches the port
	// <nil>
}

// memprovider serves the description it finds in Spec.UserData: the
// answers an embedder's test sees are the guest's.
func Example_memprovider() {
	ctx := context.Background()
	target := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer target.Close()
	addr := strings.TrimPrefix(target.URL, "http://")
	_, port, _ := net.SplitHostPort(addr)
	p, _ := strconv.Atoi(port)

	ud, err := guest.UserData(guest.Config{
		Users:               []guest.User{{Name: "probe", Password: "example-only"}},
		AllowedClients:      []string{"127.0.0.1"},
		AllowedDestinations: []guest.Destination{{Ports: []int{p}}},
	}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	c := memprovider.New(&memprovider.Options{ServeProxies: true})
	defer c.Close()
	inst, err := c.Create(ctx, egressproxy.Spec{Name: "proxy-a", UID: "uid-a", UserData: ud})
	if err != nil {
		fmt.Println(err)
		return
	}
	creds := &health.ProbeOptions{Username: "probe", Password: "example-only"}
	fmt.Println("without credentials:", health.Probe(ctx, inst.Address(), addr, nil).Kind)
	fmt.Println("with them:", health.Probe(ctx, inst.Address(), addr, creds).OK)
	r := health.Probe(ctx, inst.Address(), "127.0.0.1:22", creds)
	fmt.Println("to port 22:", r.Kind, r.StatusCode)
	// Output:
	// without credentials: auth-required
	// with them: true
	// to port 22: proxy-status 403
}
