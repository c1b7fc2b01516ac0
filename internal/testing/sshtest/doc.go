// Package sshtest is an in-process sshd for tests of SSH clients (sshconn
// and the libvirt session over it): public key auth, keepalive replies,
// direct-streamlocal channels bridged to local unix sockets. It can freeze
// (stop reading and writing, like a SIGSTOPped sshd), refuse channels and
// drop every connection. It also makes the keys and known_hosts files a
// client needs.
package sshtest
