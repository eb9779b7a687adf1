# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""nftables mode: compile.py (pure: state + config -> table content), plan.py (applied vs
wanted -> one ``nft -f`` transaction), proxier.py (NftablesProxier, the Proxier contract).
Kernel I/O is kernel/nft.py. See docs/nftables-mode.md."""
