// Package libvirtfake is the tests' in-memory libvirtd: storage pools and
// volumes (upload and download streams on byte slices, copies inside the
// host as a dir pool makes them), domains with a
// lifecycle (define, start, destroy, undefine, state, interface addresses
// from the guest agent, DHCP leases and ARP), and the connection's
// hostname, version and domain capabilities. Its sessions have the method
// signatures of go-libvirt's *libvirt.Libvirt, so a *Session satisfies
// the small interfaces packages declare for what they call (kvm2's and the
// image cache's).
//
// A Host holds the state; Host.Do and Host.Dedicated mirror the shared and
// dedicated sessions of the module's libvirt link. Errors are libvirt.Error
// values with the codes and messages libvirtd answers, so classifiers see
// what they see in production.
//
// Tests steer it three ways. Hooks (SetHook before a call takes effect,
// SetReplyHook after, SetStreamHook between the chunks of a stream) fail
// a call, hold it (Pause, Block; a held call ends with ErrKilled when its
// session dies), or change the state while it runs. The call log (Calls,
// Log) says which calls were made, in which order. The Host's own methods
// (PutVolume, DefineDomain, UpdateDomain, …) set up and read the state
// directly, without hooks and without being logged, as another client of
// libvirtd would.
//
// Every method is safe for concurrent use. Hooks run without any lock held
// and may call the Host.
package libvirtfake
