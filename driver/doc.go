// Package driver is the contract a backend implements to run proxy
// instances behind the portable client, egressproxy.Client. Users of the
// library never import it: they open an entry with a backend's Open or New
// and hold the *egressproxy.Client it returns.
//
// A backend implements Provider (and, when it keeps base images, the
// optional ImageManager), returns errors classed with Errorf, and gives its
// users NewClient(itself). The client validates input before a call reaches
// the backend, wraps every error once with the operation and the instance,
// logs and traces every call, and closes the backend on Close; package
// drivertest is the conformance suite every backend runs.
//
// # Error text
//
// Each layer says only what the layer above does not: the client says the
// operation and the instance ("egressproxy get proxy-1: "), a backend says
// its name and entry and what failed, never the operation or the instance
// name again ("kvm2 hv1: look up domain …", "memprovider: no instance with
// UID …"). Caller input inside an error is quoted, escaped and bounded; an
// error's text is valid UTF-8 of at most 1 KiB (the client clips longer
// texts).
package driver
