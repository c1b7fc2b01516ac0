package guesttest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"testing"
	"time"
)

// ProxyServerName is the name in the proxy certificates NewTLS makes:
// a guest's address is not known before it boots, so clients verify the
// proxy by this name (tls.Config.ServerName).
const ProxyServerName = "proxy.egressproxy.test"

// TLSPair is a proxy certificate and key, and the CA that signed them.
type TLSPair struct {
	CertPEM, KeyPEM string
	// Roots holds the CA only.
	Roots *x509.CertPool
}

// ClientConfig is the TLS configuration of a client that trusts the
// pair's CA and verifies the proxy as ProxyServerName.
func (p TLSPair) ClientConfig() *tls.Config {
	return &tls.Config{RootCAs: p.Roots, ServerName: ProxyServerName, MinVersion: tls.VersionTLS12}
}

// NewTLS makes a fresh CA and a server certificate for ProxyServerName
// signed by it (ECDSA P-256, valid for a day).
func NewTLS(t testing.TB) TLSPair {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "egressproxy test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: ProxyServerName},
		DNSNames:  []string{ProxyServerName},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	return TLSPair{
		CertPEM: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})),
		KeyPEM:  string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})),
		Roots:   roots,
	}
}
