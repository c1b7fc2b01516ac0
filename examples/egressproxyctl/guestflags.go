package main

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"strings"

	"github.com/spf13/pflag"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/health"
)

// guestOptions are create's flags that describe the proxy the guest runs
// (package guest renders them into the user-data): closed by default, so
// a proxy needs --proxy-user or --allow-client, or --open.
type guestOptions struct {
	user, passFile    string
	clients, domains  []string
	ports             []int
	certFile, keyFile string
	open              bool
}

func (g *guestOptions) bind(f *pflag.FlagSet) {
	f.StringVar(&g.user, "proxy-user", "", "the proxy's basic-auth user (its password from --proxy-password-file or $EGRESSPROXYCTL_PROXY_PASSWORD); renders the user-data")
	f.StringVar(&g.passFile, "proxy-password-file", "", "file holding the proxy user's password (default: $EGRESSPROXYCTL_PROXY_PASSWORD)")
	f.StringSliceVar(&g.clients, "allow-client", nil, "client address or CIDR range the proxy serves (repeatable); renders the user-data")
	f.IntSliceVar(&g.ports, "allow-port", nil, "CONNECT port the proxy allows (repeatable; default 443 only)")
	f.StringSliceVar(&g.domains, "allow-domain", nil, "domain (and the names under it) the allowed ports are limited to (repeatable; default any host)")
	f.StringVar(&g.certFile, "tls-cert-file", "", "PEM certificate chain: the proxy's port speaks TLS (an HTTPS proxy)")
	f.StringVar(&g.keyFile, "tls-key-file", "", "PEM private key of --tls-cert-file")
	f.BoolVar(&g.open, "open", false, "allow a proxy with neither --proxy-user nor --allow-client: it tunnels for anyone who reaches its port")
}

// set reports whether any of the flags is given.
func (g *guestOptions) set() bool {
	return g.user != "" || g.passFile != "" || len(g.clients) > 0 || len(g.ports) > 0 || len(g.domains) > 0 ||
		g.certFile != "" || g.keyFile != "" || g.open
}

// guestFlag names the flag of each guest.Config field.
var guestFlag = strings.NewReplacer(
	"Users[0].Name", "--proxy-user", "Users[0].Password", "--proxy-password-file",
	"Users", "--proxy-user", "AllowedClients", "--allow-client",
	"AllowedDestinations[0].Ports", "--allow-port", "AllowedDestinations[0].Domains", "--allow-domain",
	"TLS.Certificate", "--tls-cert-file", "TLS.Key", "--tls-key-file", "Open", "--open", "Port", "--port",
).Replace

// userData renders the user-data of the proxy on port; password is
// $EGRESSPROXYCTL_PROXY_PASSWORD's value.
func (g *guestOptions) userData(port int, password string) (string, error) {
	c := guest.Config{Port: port, AllowedClients: g.clients, Open: g.open}
	if g.user != "" {
		if g.passFile != "" {
			b, err := os.ReadFile(g.passFile)
			if err != nil {
				return "", fileError("--proxy-password-file", err)
			}
			password = strings.TrimRight(string(b), "\r\n")
		}
		c.Users = []guest.User{{Name: g.user, Password: password}}
	}
	if len(g.ports) > 0 || len(g.domains) > 0 {
		c.AllowedDestinations = []guest.Destination{{Ports: g.ports, Domains: g.domains}}
	}
	if g.certFile != "" || g.keyFile != "" {
		cert, err := os.ReadFile(g.certFile)
		if err != nil {
			return "", fileError("--tls-cert-file", err)
		}
		key, err := os.ReadFile(g.keyFile)
		if err != nil {
			return "", fileError("--tls-key-file", err)
		}
		c.TLS = &guest.TLS{Certificate: string(cert), Key: string(key)}
	}
	ud, err := guest.UserData(c, nil)
	if err != nil {
		fes := egressproxy.FieldErrors(err)
		if len(fes) == 0 {
			return "", cmdLinef("%v", err)
		}
		var msgs []string
		for _, fe := range fes {
			msgs = append(msgs, guestFlag(fe.Error()))
		}
		return "", cmdLinef("%s", strings.Join(msgs, "; "))
	}
	return ud, nil
}

// proxyTLS is the probe's TLS to a proxy whose certificate caFile's CAs
// sign, verified as serverName (or the proxy's address when empty).
func proxyTLS(caFile, serverName string) (*tls.Config, error) {
	b, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fileError("--proxy-ca-file", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(b) {
		return nil, usagef("--proxy-ca-file %s: no PEM certificate in it", caFile)
	}
	return &tls.Config{RootCAs: roots, ServerName: serverName, MinVersion: tls.VersionTLS12}, nil
}

// egressText is the egress address a probe learned, or why it learned none.
func egressText(res health.Result) (addr, why string) {
	if res.EgressAddress.IsValid() {
		return res.EgressAddress.String(), ""
	}
	if res.EgressErr != nil {
		return "", errText(res.EgressErr)
	}
	return "", "not fetched: the probe failed"
}

// egressCell is the EGRESS column: the address, or "<none>".
func egressCell(url, addr string) string {
	if url == "" || addr != "" {
		return addr
	}
	return "<none>"
}
