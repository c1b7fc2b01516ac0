// Package guest describes the proxy a guest runs and renders the guest's
// cloud-init user-data from that description (UserData), for guest images
// that follow the project's first-boot contract: cloud-init (NoCloud)
// writes user-data's write_files before Squid starts for the first time,
// and the image has Squid 5 or later built with TLS support and its
// basic_ncsa_auth helper at /usr/lib/squid/basic_ncsa_auth, as the image
// scripts/guestimage builds does. Put the user-data in Spec.UserData and
// the same port in Spec.Port.
//
// A Config is closed by default. The proxy tunnels CONNECT only, to port
// 443 only unless AllowedDestinations names other ports (and, optionally,
// domains); it asks for credentials when Users is set (407 without valid
// ones) and serves only clients in AllowedClients when that is set (403
// for others). A Config with neither Users nor AllowedClients is refused
// by Validate unless Open says, explicitly, that anyone who reaches the
// port may use the proxy. With TLS the port speaks TLS only (an HTTPS
// proxy).
//
// Passwords are stored hashed (SHA-512 crypt); the TLS key is written
// readable by root and Squid's group only. No password or key appears in
// an error or in String; the user-data itself holds the key and must be
// treated as a secret.
//
// memprovider reads the same user-data back and enforces it on its
// loopback proxies (credentials, client ranges, destinations, TLS), so an
// embedder's tests see the answers a guest gives without a VM.
package guest
