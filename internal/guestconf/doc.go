// Package guestconf is the proxy guest's contract written once: the files
// a guest's cloud-init user-data writes (Squid's configuration, the
// password file, the TLS certificate and key), rendered from a resolved
// Policy (UserData), and that user-data read back (Parse) into a Squid that
// answers a request as the guest's Squid would. Package guest renders with
// it; memprovider serves what it reads back; the tests check that the two
// agree with the description they started from.
//
// Parse understands exactly the Squid configuration UserData writes (the
// directives and ACL types below) and refuses anything else, so nothing
// the renderer emits can escape the model a test checks it against.
package guestconf
