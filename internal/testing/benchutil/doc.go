// Package benchutil holds the measurements behind `make bench` and the
// integration benchmarks of package bench: the image under test and its HTTP
// server, the three upload paths (the library's cold fetch, `virsh
// vol-upload` over qemu+ssh, `cat | ssh 'cat > file'`), a counting proxy on
// libvirtd's socket, a kvm2 provider entry on the real stack, and health
// probes through the stack's Squid. It also has the small statistics the
// report needs (medians, paired ratios).
//
// It owns none of the stack (scripts/teststack starts it) and prints
// nothing: every function returns its figures or an error.
package benchutil
