//! A [`PoolExport`] between processes: its bytes and its file descriptor over a Unix stream
//! socket (`SCM_RIGHTS`), to the processes the exporter allows ([`PeerPolicy`]: the same user,
//! or a list of user ids), checked with the connecting process's credentials.
#![allow(unsafe_code)]

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use crate::contract::pool_export::{POOL_DESCRIPTOR_LEN, PoolExport};

/// `sendmsg` flags: on Linux, a closed peer is an error rather than a SIGPIPE. Elsewhere the
/// flag does not exist; a closed peer raises SIGPIPE, which most programs ignore.
#[cfg(target_os = "linux")]
const SEND_FLAGS: libc::c_int = libc::MSG_NOSIGNAL;
#[cfg(not(target_os = "linux"))]
const SEND_FLAGS: libc::c_int = 0;

/// `recvmsg` flags: on Linux, received descriptors are close-on-exec from the start; elsewhere
/// [`PoolExport::receive`] sets the flag right after.
#[cfg(target_os = "linux")]
const RECV_FLAGS: libc::c_int = libc::MSG_CMSG_CLOEXEC;
#[cfg(not(target_os = "linux"))]
const RECV_FLAGS: libc::c_int = 0;
use crate::error::EmmError;

/// Which processes may receive a pool's file descriptor (and so reach all of the pool's
/// memory): checked against the credentials of the process at the other end of the socket
/// (`SO_PEERCRED`) before anything is sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PeerPolicy {
    /// Processes of the exporter's own (effective) user. The default.
    #[default]
    SameUser,
    /// The exporter's user and these user ids.
    Uids(Vec<u32>),
}

impl PeerPolicy {
    fn allows(&self, uid: u32, me: u32) -> bool {
        uid == me || matches!(self, PeerPolicy::Uids(list) if list.contains(&uid))
    }
}

/// What a refused peer receives instead of an export: this marker, its own uid and the
/// exporter's, in a payload of the export's length.
const DENIED: &[u8; 7] = b"EMMDENY";

/// The effective user id of this process.
fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The user id of the process at the other end of `socket`, as the kernel recorded it when it
/// connected.
fn peer_uid(socket: &UnixStream) -> io::Result<u32> {
    #[cfg(target_os = "linux")]
    {
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: `cred` is a writable ucred and `len` its size; the socket is open.
        let r = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&raw mut cred).cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(cred.uid)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let (mut uid, mut gid) = (0, 0);
        // SAFETY: `uid` and `gid` are writable; the socket is open.
        if unsafe { libc::getpeereid(socket.as_raw_fd(), &mut uid, &mut gid) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(uid)
    }
}

/// Binds a Unix socket at `path` that only this process's user may connect to (mode 0600): the
/// listening end for [`PoolExport::send`]. The credentials are checked again on every send,
/// so a connection made before the mode is set gains nothing.
pub fn bind_owner_only(path: impl AsRef<Path>) -> io::Result<UnixListener> {
    let listener = UnixListener::bind(path.as_ref())?;
    std::fs::set_permissions(path.as_ref(), std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

impl PoolExport {
    /// Sends the export over a connected Unix stream socket to a process of this user: the
    /// descriptor's bytes as data, the file descriptor as `SCM_RIGHTS`. The receiving process
    /// calls [`receive`](Self::receive). This export keeps its own descriptor (the receiver
    /// gets a duplicate). A process of another user is refused, on both sides; allow others
    /// with [`send_to`](Self::send_to).
    pub fn send(&self, socket: &UnixStream) -> Result<(), EmmError> {
        self.send_to(socket, &PeerPolicy::SameUser)
    }

    /// As [`send`](Self::send), to the processes `policy` allows. A refused process gets a
    /// message that says so (its [`receive`](Self::receive) fails with it), and this call
    /// fails with [`EmmError::PoolTransfer`] naming both users.
    pub fn send_to(&self, socket: &UnixStream, policy: &PeerPolicy) -> Result<(), EmmError> {
        let fail = |error| EmmError::PoolTransfer {
            what: "sending a pool export",
            error,
        };
        let (peer, me) = (peer_uid(socket).map_err(fail)?, my_uid());
        if !policy.allows(peer, me) {
            let mut refusal = [0u8; POOL_DESCRIPTOR_LEN];
            refusal[..7].copy_from_slice(DENIED);
            refusal[7..11].copy_from_slice(&peer.to_le_bytes());
            refusal[11..15].copy_from_slice(&me.to_le_bytes());
            let mut s = socket;
            // The refusal is a courtesy to the other side; this side's error is what counts.
            let _ = s.write_all(&refusal);
            tracing::warn!(pool = %self.id(), peer, "pool export refused to a process of another user");
            return Err(fail(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "the connecting process runs as uid {peer}, and this pool goes to {} only; \
                     allow it with PoolExport::send_to(socket, &PeerPolicy::Uids(vec![{peer}]))",
                    match policy {
                        PeerPolicy::SameUser => format!("this process's user (uid {me})"),
                        PeerPolicy::Uids(list) => format!("uid {me} and {list:?}"),
                    }
                ),
            )));
        }
        let payload = self.descriptor();
        let fd: libc::c_int = self.fd().as_raw_fd();
        let mut control = ControlBuffer::new();
        let mut iov = libc::iovec {
            iov_base: payload.as_ptr() as *mut libc::c_void,
            iov_len: payload.len(),
        };
        let msg = control.message(&mut iov);
        // SAFETY: `msg` points at `control`, which has room for one header with one int (its
        // length is CMSG_SPACE of one int, and it is aligned for cmsghdr), so CMSG_FIRSTHDR
        // returns a valid, writable header and CMSG_DATA room for the int.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            if cmsg.is_null() {
                return Err(fail(io::Error::other("no room for the control message")));
            }
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd);
        }
        // SAFETY: `msg` and everything it points at (`iov`, `payload`, `control`) are alive
        // and initialised for the call; the socket is open (borrowed from `socket`).
        let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &raw const msg, SEND_FLAGS) };
        if sent < 0 {
            return Err(fail(io::Error::last_os_error()));
        }
        if sent as usize != payload.len() {
            return Err(fail(io::Error::other(format!(
                "sent {sent} of {} bytes",
                payload.len()
            ))));
        }
        tracing::debug!(pool = %self.id(), fd, "pool export sent");
        Ok(())
    }

    /// Receives one export that [`send`](Self::send) sent over `socket`. Blocks until it
    /// arrives (or the socket's read timeout passes).
    pub fn receive(socket: &UnixStream) -> Result<PoolExport, EmmError> {
        let fail = |error| EmmError::PoolTransfer {
            what: "receiving a pool export",
            error,
        };
        let mut payload = [0u8; POOL_DESCRIPTOR_LEN];
        let mut control = ControlBuffer::new();
        let mut iov = libc::iovec {
            iov_base: payload.as_mut_ptr().cast(),
            iov_len: payload.len(),
        };
        let mut msg = control.message(&mut iov);
        let received = loop {
            // SAFETY: `msg` points at `payload` and `control`, both writable for their stated
            // lengths for the call; the socket is open (borrowed from `socket`).
            let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &raw mut msg, RECV_FLAGS) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(fail(e));
            }
        };
        // Take ownership of every descriptor that arrived first, so none leaks on an error.
        let mut fds = Vec::new();
        // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR / CMSG_NXTHDR walk only within
        // `msg_controllen` bytes of `control`; each SCM_RIGHTS header's data holds
        // (cmsg_len - CMSG_LEN(0)) / size_of::<c_int>() descriptors, now owned by this process.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                    let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    for k in 0..bytes / size_of::<libc::c_int>() {
                        let raw = std::ptr::read_unaligned(data.add(k));
                        fds.push(OwnedFd::from_raw_fd(raw));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&raw const msg, cmsg);
            }
        }
        #[cfg(not(target_os = "linux"))]
        for fd in &fds {
            // SAFETY: `fd` is an open descriptor this process owns (received just above).
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(fail(io::Error::other(
                "the control message was truncated (more than one descriptor was sent)",
            )));
        }
        if received == 0 {
            return Err(fail(io::ErrorKind::UnexpectedEof.into()));
        }
        // A stream socket may deliver the data in pieces; the descriptor came with the first.
        if received < payload.len() {
            let mut rest = socket;
            rest.read_exact(&mut payload[received..]).map_err(fail)?;
        }
        if payload.starts_with(DENIED) {
            let uid = |i: usize| u32::from_le_bytes(payload[i..i + 4].try_into().expect("4 bytes"));
            return Err(fail(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "the exporting process (uid {}) does not let this process (uid {}) import its \
                     pool; the exporter must allow it (PoolExport::send_to with PeerPolicy::Uids)",
                    uid(11),
                    uid(7)
                ),
            )));
        }
        let mut fds = fds.into_iter();
        let (Some(fd), None) = (fds.next(), fds.next()) else {
            return Err(fail(io::Error::other(
                "the message did not carry exactly one file descriptor",
            )));
        };
        let export = PoolExport::from_descriptor(&payload, fd)?;
        tracing::debug!(pool = %export.id(), "pool export received");
        Ok(export)
    }
}

/// Room for one control message with one file descriptor, aligned for `cmsghdr`.
struct ControlBuffer {
    words: [u64; 8],
}

impl ControlBuffer {
    fn new() -> ControlBuffer {
        ControlBuffer { words: [0; 8] }
    }

    fn len(&self) -> usize {
        // SAFETY: CMSG_SPACE is pure arithmetic.
        let space = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as usize;
        debug_assert!(space <= size_of::<[u64; 8]>());
        space
    }

    /// A message header over one data buffer (`iov`) and this control buffer; both must
    /// outlive its use.
    fn message(&mut self, iov: &mut libc::iovec) -> libc::msghdr {
        // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths); the fields used
        // are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov;
        msg.msg_iovlen = 1;
        msg.msg_controllen = self.len() as _;
        msg.msg_control = self.words.as_mut_ptr().cast();
        msg
    }
}
